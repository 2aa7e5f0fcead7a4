"""Prompts as operators hand them to ``kvstore explain`` and ``kvstore export --prefix-of``:
token ids as JSON (inline, a file or stdin), or text run through a local tokenizer.

Accepted token files: a JSON array of ints; a JSON object with one of ``prompt_token_ids``,
``input_ids``, ``token_ids`` or ``tokens`` (an array, or an array holding one array: a
batch of one); or ints separated by whitespace or commas.
"""

from __future__ import annotations

import json
import os
import sys
from array import array

from kvstore.admin.common import AdminError

__all__ = ["PromptError", "parse_tokens", "read_tokens", "tokenize"]

_KEYS = ("prompt_token_ids", "input_ids", "token_ids", "tokens")
#: a prompt file larger than this is refused (10M tokens as JSON is ~80 MB)
MAX_PROMPT_BYTES = 256 << 20


class PromptError(AdminError):
    """The prompt cannot be read as token ids (the message says what was expected)."""


def parse_tokens(text: str, where: str = "the prompt") -> list[int]:
    """Token ids from ``text`` (see the module docstring for the accepted forms)."""
    s = text.strip()
    if not s:
        raise PromptError(f"{where} is empty; give token ids as a JSON array, e.g. [1, 2, 3]")
    if s[0] in "[{":
        try:
            obj = json.loads(s)
        except ValueError as e:
            raise PromptError(f"{where} is not valid JSON ({e}); give a JSON array of token "
                              "ids, e.g. [1, 2, 3]") from None
        except RecursionError:
            raise PromptError(f"{where} is JSON nested thousands of levels deep; give a JSON "
                              "array of token ids, e.g. [1, 2, 3]") from None
        return _from_json(obj, where)
    try:
        return _checked(array("q", (int(w) for w in s.replace(",", " ").split())).tolist(), where)
    except (ValueError, OverflowError):
        raise PromptError(f"{where} holds something other than integers; give token ids as a "
                          "JSON array or whitespace-separated ints (or text with --tokenizer)") from None


def _from_json(obj: object, where: str) -> list[int]:
    if isinstance(obj, dict):
        key = next((k for k in _KEYS if k in obj), None)
        if key is None:
            raise PromptError(f"{where} is a JSON object without any of {', '.join(_KEYS)}")
        obj = obj[key]
    if isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], list):
        obj = obj[0]  # a batch of one, as tokenizers return it
    if not isinstance(obj, list) or not all(type(t) is int for t in obj):
        raise PromptError(f"{where} must be a JSON array of integer token ids")
    return _checked(obj, where)


def _checked(tokens: list[int], where: str) -> list[int]:
    bad = next((t for t in tokens if not 0 <= t < 2**32), None)
    if bad is not None:
        raise PromptError(f"{where}: token id {bad} is out of range [0, 2**32)")
    return tokens


def read_tokens(path: str) -> list[int]:
    """Token ids from the file ``path`` (``-``: standard input)."""
    if path == "-":
        text = sys.stdin.read(MAX_PROMPT_BYTES + 1)
        where = "the prompt on stdin"
    else:
        try:
            size = os.path.getsize(path)
            if size > MAX_PROMPT_BYTES:
                raise PromptError(f"{path} has {size} bytes; prompt files are read up to "
                                  f"{MAX_PROMPT_BYTES >> 20} MiB")
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PromptError(f"cannot read the prompt file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise PromptError(f"{path} is not UTF-8 text; give token ids as JSON") from None
        where = path
    if len(text) > MAX_PROMPT_BYTES:
        raise PromptError(f"{where} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
    return parse_tokens(text, where)


def tokenize(text: str, tokenizer_dir: str, *, add_special_tokens: bool = True) -> list[int]:
    """``text`` through the Hugging Face tokenizer saved in ``tokenizer_dir`` (offline: no
    download). Use the same ``add_special_tokens`` (and chat template, applied beforehand)
    as the engine, or the keys differ from the engine's."""
    if not os.path.isdir(tokenizer_dir):
        raise PromptError(f"--tokenizer {tokenizer_dir}: not a directory (give the local "
                          "directory holding tokenizer.json / tokenizer_config.json)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise PromptError("--tokenizer needs the transformers package: pip install "
                          "'kvstore[hf]' (or give token ids as JSON)") from None
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise PromptError(f"cannot load a tokenizer from {tokenizer_dir}: {e}") from None
    ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    return _checked([int(t) for t in ids], "the tokenized text")
