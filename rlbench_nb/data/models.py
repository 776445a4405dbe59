"""`model.path` -> the from_pretrained folder every role loads: a Hugging Face folder as it is (checked), or a
GGUF file (llama.cpp / ollama's format) converted once through transformers' own GGUF reader.

    model_folder("models/SmolLM2-135M-Instruct")           # a folder with config.json and a tokenizer
    model_folder("models/SmolLM2-135M-Instruct.Q4_1.gguf")  # -> ~/.cache/rlbench_nb/gguf/<name>-<key>/

Why convert instead of passing `gguf_file=` to every loader: the controller, the trainers, the HF engine, vLLM,
the critic, `rlbench-nb weights` and the checkpoints all read one folder (config.json, model.safetensors, the
tokenizer files); a GGUF becomes that folder once, so no role has a second loading path to get wrong, and the
dequantization (~20 s for 135M parameters on 2 cores) is paid once per file, not once per worker and session.
transformers dequantizes GGUF to floating point: the folder holds the quantized model's values in fp32, and
training changes them from there. The tokenizer (and its chat template) comes from the same file.

Cache: $RLBENCH_NB_CACHE or ~/.cache/rlbench_nb, keyed by the file's resolved path, size and modification time
and transformers' version (a file replaced in place is converted again). On a multi-node cluster the workers of
other nodes read the folder at the same path: point RLBENCH_NB_CACHE at storage every node sees.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ..config import ConfigError

log = logging.getLogger(__name__)

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
SOURCE_FILE = "gguf_source.json"  # in a converted folder: the GGUF it came from


def model_folder(path: str | Path) -> Path:
    """The from_pretrained folder for model.path `path` (a folder, a .gguf file, or a folder holding one .gguf and
    no config.json); one clear line when it cannot be one."""
    p = Path(path).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            p = ggufs[0]
        elif len(ggufs) > 1:
            raise ConfigError(f"model.path={path} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}): "
                              f"name one of them, e.g. model.path={ggufs[0]}")
    if p.is_file() and p.suffix.lower() == ".gguf":
        return gguf_folder(p)
    if not p.is_dir():
        raise ConfigError(f"model.path={path} is neither a folder nor a .gguf file: give a local Hugging Face model "
                          "folder (config.json, weights, tokenizer) or a GGUF file")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path={path} has no config.json: give a Hugging Face model folder (save_pretrained "
                          "writes one) or a .gguf file")
    if not any((p / name).is_file() for name in TOKENIZER_MARKERS):
        raise ConfigError(f"model.path={path} has no tokenizer (none of {', '.join(TOKENIZER_MARKERS)}): copy the "
                          "tokenizer files of the model it comes from into it (tokenizer.save_pretrained(folder))")
    return p


def gguf_folder(file: Path, cache: Path | None = None) -> Path:
    """The cached from_pretrained folder of a GGUF file (under `cache`, default $RLBENCH_NB_CACHE or
    ~/.cache/rlbench_nb), converted on first use (atomically: a half-written folder is never used)."""
    from .tasks.warm_start import cache_root
    target = (cache or cache_root()) / "gguf" / f"{file.stem}-{_gguf_key(file)}"
    if (target / SOURCE_FILE).is_file():
        return target
    log.warning("model.path=%s: converting the GGUF file to a from_pretrained folder once (cached in %s)", file, target)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(file, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: its folder is the same conversion
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(file: Path, out: Path) -> Path:
    """Write `file` (GGUF) as a from_pretrained folder `out`: config, fp32 safetensors, tokenizer with its chat
    template. transformers refuses save_pretrained on a model loaded from GGUF, so the weights go through a
    model built fresh from the same config."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(file.parent), file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with _quiet():
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as e:
        raise ConfigError(f"model.path={file}: reading GGUF needs the gguf package ({e}): pip install 'gguf>=0.10' "
                          "(a dependency of rlbench-nb: reinstall it)") from None
    except Exception as e:  # noqa: BLE001 - transformers' reader raises ValueError, KeyError, struct errors, ...
        raise ConfigError(f"model.path={file}: transformers {transformers.__version__} cannot read this GGUF file "
                          f"({type(e).__name__}: {str(e)[:200]}): convert it to a Hugging Face folder with "
                          "llama.cpp's tools or give the model's original folder") from None
    out.mkdir(parents=True)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    fresh.tie_weights()
    untied = [k for k in missing if fresh.get_parameter(k).is_meta] if missing else []
    if unexpected or untied:
        raise ConfigError(f"model.path={file}: the GGUF's tensors do not fit its own config (missing {untied[:3]}, "
                          f"unexpected {unexpected[:3]}): give the model's original folder")
    with _quiet():
        fresh.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / SOURCE_FILE).write_text(json.dumps({"gguf": str(file.resolve()), "transformers": transformers.__version__,
                                               "parameters": sum(p.numel() for p in loaded.parameters())}))
    return out


def _gguf_key(file: Path) -> str:
    import transformers
    st = file.stat()
    blob = json.dumps([str(file.resolve()), st.st_size, st.st_mtime_ns, transformers.__version__])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@contextmanager
def _quiet():
    """transformers' progress bars off while a GGUF dequantizes and saves (they would land in notebook outputs:
    its GGUF reader uses a plain tqdm, the saving transformers' own switch)."""
    from unittest import mock

    from transformers import modeling_gguf_pytorch_utils as reader

    from ..ops.attention import no_progress_bars
    plain = (mock.patch.object(reader, "tqdm", lambda items, **_: items) if hasattr(reader, "tqdm")
             else nullcontext())  # another transformers may read without one: nothing to silence then
    with no_progress_bars(), plain:
        yield
