"""YAML as config files and `key=value` overrides are read: YAML 1.2's booleans, and a key given twice is an
error. (config.py holds the settings; this, how their text is parsed.)"""
from __future__ import annotations

import re

import yaml


class Yaml12Bools(yaml.SafeLoader):
    """safe_load with YAML 1.2's booleans: only true/false are. YAML 1.1's yes/no/on/off made
    `algo.rollout_is=off` the boolean False, which the setting ('off' | 'tis' | 'mis') refused; a bool setting
    still reads the word (pydantic takes 'off', 'no', 'on', 'yes')."""


Yaml12Bools.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Yaml12Bools.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                  list("tTfF"))


class UniqueKeyLoader(Yaml12Bools):
    """safe_load, except that a key given twice in one mapping (a section pasted twice) is an error
    instead of the last one silently winning."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: SafeLoader's flattening merges it
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"'{key}' appears twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                    "merge the two into one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)
