"""The files an exported script needs, made reachable from any folder (a cluster job's working directory,
a colleague's checkout): a parameter naming a YAML config the notebook can reach is embedded in the script
with the relative paths inside it made absolute; any other parameter naming a file or folder becomes its
absolute path (export.py's docstring says what the script then does with them).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path


def _reachable(value: str, folder: Path, parents: int = 0) -> Path | None:
    """`value` as a path from `folder` (the notebook's, which is its kernel's working directory), or from up
    to `parents` folders above it (what `Config.load` does for a config file), if it names something there."""
    p = Path(value)
    if p.is_absolute():
        return p if p.exists() else None
    for base in [folder, *list(folder.parents)[:parents]]:
        if (base / p).exists():
            return (base / p).resolve()
    return None


PATH_KEYS = (("data", "train_path"), ("data", "test_path"), ("model", "path"))


def _embeddable_config(path: Path, folder: Path) -> str:
    """The YAML text of a config file, its relative paths (data files, model, a reward file) made absolute
    against `folder`, the notebook's (they are opened from the working directory, as the notebook did)."""
    import yaml
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    changed = False
    for section, key in PATH_KEYS:
        value = (data.get(section) or {}).get(key)
        found = _reachable(value, folder) if isinstance(value, str) and value else None
        if found is not None and not Path(value).is_absolute():
            data[section][key] = str(found)
            changed = True
    fn = (data.get("reward") or {}).get("fn")
    if isinstance(fn, str) and ".py:" in fn and not Path(fn.rsplit(":", 1)[0]).is_absolute():
        file, name = fn.rsplit(":", 1)
        found = _reachable(file, folder)
        if found is not None:
            data["reward"]["fn"] = f"{found}:{name}"
            changed = True
    return yaml.safe_dump(data, sort_keys=False) if changed else text


def resolve_files(params: list, folder: Path) -> tuple[list, dict[str, str]]:
    """Parameters (export.Parameter) naming files the notebook reaches: YAML configs embedded (returned as
    {value: text}), other files and folders as absolute paths."""
    out, embedded = [], {}
    for p in params:
        text = p.default if isinstance(p.default, str) and p.default else None
        config = _reachable(text, folder, parents=3) if text and text.endswith((".yaml", ".yml")) else None
        if config is not None and config.is_file():
            embedded[text] = _embeddable_config(config, folder)
        elif text and not Path(text).is_absolute() and (found := _reachable(text, folder)) is not None:
            p = replace(p, default=str(found))
        out.append(p)
    return out, embedded
