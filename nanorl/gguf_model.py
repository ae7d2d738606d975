"""GGUF files as a starting policy: `--model path/to/model.gguf`, or a directory that holds one.

GGUF is llama.cpp's one-file format: the weights (often 4- or 8-bit quantized) with the tokenizer and
chat template as metadata. transformers reads it (its GGUF support needs the `gguf` package) and
dequantizes every tensor on load. Start at `locate` (a --model path → what `from_pretrained` reads and
its `gguf_file` argument), then `load_causal_lm` / `load_tokenizer`, which nanorl/policy.py load_model
calls. Key choices: the weights land in fp32, the master weights of any policy, so training never sees
the quantization; transformers marks the model as quantized "with GGUF" and its save_pretrained
refuses such a model, so `make_plain` removes those marks at load: every checkpoint and
`python -m nanorl.export` then write an ordinary Hugging Face directory that loads without the GGUF
file. A directory with a config.json is a Hugging Face directory, even when a .gguf lies beside it.
vLLM is not given GGUF files (the run samples with the HF engine; export first to use vLLM).
"""
from __future__ import annotations

import importlib.util
import os

PIP = "pip install gguf"


def _found(path: str) -> tuple[str, str] | None:
    """(directory, file name) of the GGUF file `path` names or the one a directory holds (a directory
    with a config.json is a Hugging Face directory); None for anything else. A missing .gguf file or
    several in one directory: one line."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such GGUF file")
        return os.path.split(os.path.abspath(path))
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(found)}); name one: "
                         f"--model {os.path.join(path, found[0])}")
    return (path, found[0]) if found else None


def locate(path: str) -> tuple[str, dict]:
    """(what from_pretrained reads, its extra keyword arguments): (the file's directory, {"gguf_file":
    its name}) for a GGUF file or a directory holding one (and no config.json); (path, {}) for
    anything else. A missing .gguf file, several in one directory, or no `gguf` package: one line."""
    found = _found(path)
    if found is None:
        return path, {}
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"{path} is a GGUF file: loading it needs the gguf package ({PIP})")
    return found[0], {"gguf_file": found[1]}


def is_gguf(path: str) -> bool:
    """Whether --model `path` names a GGUF file (or a directory holding one) rather than a HF model."""
    return _found(path) is not None


def load_causal_lm(path: str, **kwargs):
    """AutoModelForCausalLM.from_pretrained(path, **kwargs) for a HF model or a GGUF file; a GGUF
    model comes back plain (`make_plain`), its weights dequantized into kwargs' dtype."""
    from transformers import AutoModelForCausalLM

    where, extra = locate(path)
    model = AutoModelForCausalLM.from_pretrained(where, **extra, **kwargs)
    if extra:
        make_plain(model)
    return model


def load_tokenizer(path: str):
    """The tokenizer of a HF model, or the one (with its chat template) in a GGUF file's metadata."""
    from transformers import AutoTokenizer

    where, extra = locate(path)
    return AutoTokenizer.from_pretrained(where, **extra)


def load_config(path: str):
    """The model's config (AutoConfig), read from a GGUF file's metadata too."""
    from transformers import AutoConfig

    where, extra = locate(path)
    return AutoConfig.from_pretrained(where, **extra)


def make_plain(model) -> None:
    """Remove the marks transformers leaves on a model loaded from GGUF. Its weights are already
    dequantized tensors, but save_pretrained refuses a model quantized "with GGUF ... not serializable";
    without the quantizer, the config's quantization_config and the is_quantized flag it saves an
    ordinary directory (safetensors in the weights' dtype) that loads back as the same model."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
