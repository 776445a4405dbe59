"""Run a tinker-cookbook recipe as published (`python tinker_recipe.py rl_loop key=value ...`), in the Tinker client's
environment (tests/tinker_client.py), with two things of the test harness around it, none in the recipe:
`datasets.load_dataset` returns the rows in $RECIPE_ROWS (the recipe's dataset in its published schema), and the
renderer for the local model folder is $RECIPE_RENDERER (the cookbook knows renderers for hub names only)."""
import json
import os
import runpy
import sys

import datasets
from tinker_cookbook import model_info


def load_local_rows(path, name=None, *args, **kwargs):
    with open(os.environ["RECIPE_ROWS"]) as f:
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(json.load(f))})


datasets.load_dataset = load_local_rows
model_info.get_recommended_renderer_name = lambda model_name: os.environ["RECIPE_RENDERER"]

recipe, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
runpy.run_module(f"tinker_cookbook.recipes.{recipe}", run_name="__main__", alter_sys=True)
