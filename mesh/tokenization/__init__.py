"""A model's real tokenizer and chat template, and a pool that runs them off the event loop.

- ``resolve_model_dir(spec) -> Path``: a folder, or a model id in the local Hugging Face cache (``hub.py``).
- ``load_model_dir(path, chat_template_file=None) -> ModelFiles``: tokenizer.json, the chat template and the
  special tokens of a local model folder (``model_dir.py``).
- ``ChatTemplate``: renders messages exactly as ``transformers``' ``apply_chat_template`` (``chat.py``).
- ``ModelTokenizer``: blocking ``encode`` / ``render_chat``; ``TokenizerPool``: the same, awaited, in threads
  with a bounded queue (``pool.py``).
- ``bench.py``: tokens/s and added latency (``mesh bench tokenizer``).

Needs the ``tokenizers`` extra (``tokenizers``, ``jinja2``); importing this package does not.
"""

from .hub import hub_cache_dir, resolve_model_dir
from .chat import ChatTemplate, ContentFormat, detect_content_format, normalize_messages
from .model_dir import ModelFiles, load_model_dir, read_chat_template_file
from .pool import ModelTokenizer, TokenizerBusy, TokenizerPool, TooManyTokens

__all__ = [
    "ChatTemplate",
    "ContentFormat",
    "detect_content_format",
    "normalize_messages",
    "hub_cache_dir",
    "resolve_model_dir",
    "ModelFiles",
    "load_model_dir",
    "read_chat_template_file",
    "ModelTokenizer",
    "TokenizerBusy",
    "TokenizerPool",
    "TooManyTokens",
]
