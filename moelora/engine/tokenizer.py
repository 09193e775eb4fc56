"""The engine's tokenizer: read from local files only, with the chat template `--chat-template` gives.

A model directory without tokenizer files is served all the same: prompts are token ids, the
outputs are token ids without text, and what needs text (text prompts, chat, stop strings) is
refused with the reason."""
from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from moelora.engine.config import EngineConfig

logger = logging.getLogger(__name__)
# A tokenizer's vocabulary is in one of these (fast tokenizers, SentencePiece, BPE, WordPiece);
# tokenizer_config.json alone makes transformers build an empty one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# Characters only a template has: without them --chat-template names a file, as vLLM decides.
_JINJA_CHARS = "{}\n"


def load_tokenizer(config: EngineConfig) -> tuple[PreTrainedTokenizerBase | None, str | None]:
    """The tokenizer, or None and why there is none (for the errors of requests that need one).
    ValueError naming the field for a tokenizer_path that is no local tokenizer, and for a chat
    template that cannot be read or does not render; no network access."""
    path = Path(config.tokenizer_path or config.model_path)
    field = "tokenizer_path" if config.tokenizer_path else "model_path"
    if not path.is_dir():
        raise ValueError(f"EngineConfig.{field} {str(path)!r} is not a local directory; moelora reads local tokenizer "
                         "files, not Hub ids")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing = f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})"
        if config.tokenizer_path or config.chat_template is not None:
            raise ValueError(f"EngineConfig.{'tokenizer_path' if config.tokenizer_path else 'chat_template'}: {missing}")
        return None, f"{missing}: prompts must be token ids (or start the engine with a tokenizer_path)"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # json's errors and the tokenizers library's plain Exception, neither naming the directory
        raise ValueError(f"EngineConfig.{field} {str(path)!r}: its tokenizer files cannot be read: "
                         f"{type(e).__name__}: {e}") from e
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
        _check_renders(tokenizer, "EngineConfig.chat_template")
    elif tokenizer.chat_template is not None:
        try:
            _check_renders(tokenizer, f"EngineConfig.{field} {str(path)!r}: its chat template")
        except ValueError as e:  # the model's own: completions and token ids serve on, chat has no template
            logger.warning("%s; chat requests are refused (replace it with chat_template, --chat-template)", e)
            tokenizer.chat_template = None
    return tokenizer, None


def _check_renders(tokenizer: PreTrainedTokenizerBase, what: str) -> None:
    """ValueError naming `what` unless the tokenizer's chat template renders a user's message: one that cannot is
    no chat template."""
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's syntax and template errors, the template's own raise_exception
        raise ValueError(f"{what} does not render a user message: {type(e).__name__}: {e}") from e


def read_chat_template(value: str) -> str:
    """--chat-template: the file it names, or the template itself when it has a character only a
    template has (braces, newlines)."""
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path, or undecodable text
        if any(c in value for c in _JINJA_CHARS):
            return value
        raise ValueError(f"EngineConfig.chat_template {value!r} is neither a readable file ({e}) nor a Jinja "
                         "template") from e
