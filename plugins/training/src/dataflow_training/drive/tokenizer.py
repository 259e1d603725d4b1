"""The run's tokenizer: kept in the run folder, recorded in every checkpoint, exported.

A run records in each checkpoint's manifest (``tokenizer``) what made its token ids, as
the feed says (its optional ``tokenizer`` field):

- ``{"kind": "bytes"}``: byte tokens, id = byte (the text and embedded feeds, byte shards);
- ``{"kind": "file", "file": "tokenizer.json", "sha256", "source", "vocab_size"}``: a
  ``tokenizers`` file (shards ``data prepare`` wrote with ``bpe:N`` or a tokenizer
  file), copied into the run folder when the run starts (``keep_tokenizer``), so that the
  run outlives its data folder; ``source`` is where it came from;
- None: the data does not say (shards without a tokenizer beside them).

``export --hf`` writes it beside the weights (``HFTokenizer``): ``tokenizer.json``,
``tokenizer_config.json`` and, where the tokenizer has ``<|endoftext|>``, a
``special_tokens_map.json``, which ``transformers.AutoTokenizer.from_pretrained`` loads.
For byte tokens it builds a byte-level tokenizer whose ids are the bytes (with the
``tokenizers`` library).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import attrs

from dataflow_training.drive.checkpoint import file_sha256

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
#: the document separator ``data prepare`` trains into a BPE; the export's eos and bos
END_OF_TEXT = "<|endoftext|>"
BYTE_VOCAB = 256


class TokenizerError(ValueError):
    """The run's tokenizer cannot be kept or exported: names the file and what is wrong."""


def keep_tokenizer(feed: Any, out: Path, *, resumed: bool, writes: bool) -> dict[str, Any] | None:
    """The manifest's record of ``feed``'s tokenizer (module docstring); a tokenizer file
    is copied to ``out/tokenizer.json`` (where this process writes). A resumed run keeps
    the copy it made, and data whose tokenizer is another file is refused."""
    tokenizer = getattr(feed, "tokenizer", None)  # optional in the feed protocol
    if tokenizer == "bytes":
        return {"kind": "bytes"}
    if tokenizer is None:
        return None
    source = Path(tokenizer)
    kept = out / TOKENIZER_FILE
    digest = file_sha256(source)
    if resumed and kept.is_file() and file_sha256(kept) != digest:
        raise TokenizerError(
            f"{source} is not the tokenizer this run trained with ({kept}): its data was "
            "prepared with another tokenizer; resume on the run's data, or start a new run "
            "in another --out"
        )
    if writes and not (kept.is_file() and file_sha256(kept) == digest):
        partial = kept.with_name(f".{TOKENIZER_FILE}.partial")
        shutil.copyfile(source, partial)
        os.replace(partial, kept)
    return {
        "kind": "file",
        "file": TOKENIZER_FILE,
        "sha256": digest,
        "source": str(source),
        "vocab_size": getattr(feed, "vocab_size", None),
    }


@attrs.frozen
class HFTokenizer:
    """A run's tokenizer, found and checked, ready to write beside an HF export."""

    #: the tokenizer.json to copy, or None: build the byte-level one
    file: Path | None
    #: what the ``wrote`` line says of it
    what: str

    @classmethod
    def of_checkpoint(cls, manifest: dict[str, Any], checkpoint: Path) -> HFTokenizer | None:
        """The tokenizer a checkpoint's manifest records (None: it records none). The
        run folder's copy comes first, then the file it was copied from; a copy that is
        missing or changed is an error naming the files. Byte tokens need the
        ``tokenizers`` library: its absence is an error saying so."""
        record = manifest.get("tokenizer")
        if not isinstance(record, dict):
            return None
        if record.get("kind") == "bytes":
            try:
                import tokenizers  # noqa: F401
            except ImportError:
                raise TokenizerError(
                    "the run's byte-level tokenizer is built with the tokenizers library, "
                    "which is not installed (pip install tokenizers), or pass --no-tokenizer"
                ) from None
            return cls(None, "byte-level tokenizer")
        places = [checkpoint.parent / str(record.get("file")), Path(str(record.get("source")))]
        for place in places:
            if place.is_file() and file_sha256(place) == record.get("sha256"):
                return cls(place, f"tokenizer of {place}")
        raise TokenizerError(
            f"the run's tokenizer is in neither {places[0]} nor {places[1]} (or either "
            f"changed since: sha256 {str(record.get('sha256'))[:16]}...); copy it back, or "
            "pass --no-tokenizer"
        )

    def write(self, folder: Path) -> list[str]:
        """Write the tokenizer files into the export ``folder`` (beside its
        ``config.json``, whose context length it takes and whose missing eos/bos ids it
        fills with ``<|endoftext|>``'s); returns their names."""
        tokenizer = folder / TOKENIZER_FILE
        if self.file is None:
            byte_level_tokenizer().save(str(tokenizer))
        else:
            shutil.copyfile(self.file, tokenizer)
        model = json.loads((folder / "config.json").read_text())
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        context = model.get("max_position_embeddings", model.get("n_positions"))
        if context:
            config["model_max_length"] = context
        written = [TOKENIZER_FILE, CONFIG_FILE]
        eos = _special_id(tokenizer, END_OF_TEXT)
        if eos is not None:
            special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}
            config.update(special)
            _write_json(folder / SPECIAL_TOKENS_FILE, special)
            written.append(SPECIAL_TOKENS_FILE)
            fill = {k: eos for k in ("bos_token_id", "eos_token_id") if model.get(k) is None}
            if fill:
                _write_json(folder / "config.json", model | fill)
        _write_json(folder / CONFIG_FILE, config)
        return written


def _special_id(tokenizer: Path, content: str) -> int | None:
    """The id of the added token ``content`` in a tokenizer.json, or None."""
    data = json.loads(tokenizer.read_text(encoding="utf-8"))
    for token in data.get("added_tokens") or ():
        if token.get("content") == content:
            return int(token["id"])
    return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def byte_chars() -> dict[int, str]:
    """byte -> the character the byte-level pre-tokenizer writes it as: the printable
    Latin-1 bytes as themselves, every other byte, in order, as U+0100 onwards (the
    ``tokenizers`` library's ByteLevel alphabet)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(BYTE_VOCAB) if byte not in printable]
    chars = {byte: chr(byte) for byte in printable}
    chars |= {byte: chr(0x100 + index) for index, byte in enumerate(others)}
    return chars


def is_byte_level(path: Path) -> bool:
    """Whether the tokenizer.json at ``path`` is one ``byte_level_tokenizer`` wrote (an
    export of a byte run): 256 ids, no merges, no added tokens."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data["model"]
        return (
            len(model["vocab"]) == BYTE_VOCAB
            and not model["merges"]
            and not data.get("added_tokens")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def byte_level_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` whose ids are the text's UTF-8 bytes: a BPE of the 256
    byte characters and no merges, behind the byte-level pre-tokenizer (no regex split,
    no prefix space) and decoder."""
    # an export without the tokenizers package fails in one line (export_cli) before this
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in byte_chars().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
