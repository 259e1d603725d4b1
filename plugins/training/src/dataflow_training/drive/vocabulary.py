"""The model's vocabulary of a run: ``--vocab-size``, the data's tokenizer, or the preset's.

``choose_vocab`` decides it once, when the run opens its feed, before the step compiles:

- ``--vocab-size N`` is the model's, whatever the preset says; the data's ids must fit it;
- else, when the data's ids come from a ``tokenizer.json`` (shards ``data prepare`` wrote
  with ``bpe:N`` or a tokenizer file), the tokenizer's vocabulary: a tiny preset trains on
  ``bpe:300`` shards, and a real preset on shards of another tokenizer gets an embedding
  of that tokenizer's size;
- else (byte tokens, or shards with no tokenizer beside them) the preset's: byte ids
  0..255 fit every preset, and ids past the preset's vocabulary are refused naming
  ``--vocab-size``;
- a run started from ``--init`` has the folder's vocabulary (its weights' rows), and a
  resumed run its checkpoint's (whichever way that run chose it, even before this rule):
  a ``--vocab-size`` that differs, or data whose ids do not fit, is refused.

The model's vocabulary is exactly the tokenizer's (as the HF export needs); the step
stores its tables padded to the config's ``vocab_multiple`` (``kit.decoder_math``), which
nothing outside the step sees. The vocabulary goes
into the run's overrides only where it differs from the preset's, so a run on byte data
keeps the preset's config (and its older checkpoints resume unchanged).
"""

from __future__ import annotations

from typing import Any

import attrs


class VocabError(ValueError):
    """A vocabulary the data's ids do not fit: one line naming both sizes and the option."""


@attrs.frozen
class Vocabulary:
    """The model's vocabulary (``size``) and, where it is not the preset's, the line the
    run says about it (``note``, for the ``data:`` line)."""

    size: int
    note: str = ""


def choose_vocab(
    preset_vocab: int,
    feed: Any,
    data: str,
    *,
    given: int | None = None,
    init_vocab: int | None = None,
    kept: int | None = None,
) -> Vocabulary:
    """The vocabulary of a run of a preset whose config has ``preset_vocab`` on ``feed``
    (opened from ``--data data``); ``given`` is ``--vocab-size``, ``init_vocab`` the
    ``--init`` folder's, ``kept`` the resumed checkpoint's (module docstring)."""
    # the feed protocol's optional fields: a feed that does not say is taken as fitting
    data_vocab = getattr(feed, "vocab_size", None)
    tokenizer = getattr(feed, "tokenizer", None)
    fixed = [  # (vocabulary, whose, what works instead), the first given wins
        (
            init_vocab,
            "the --init folder's model",
            "prepare the data with the folder's tokenizer.json (dataflow data prepare "
            "--tokenizer FILE)",
        ),
        (kept, "the checkpoint this run resumes", "resume on the run's data"),
    ]
    for vocab, whose, fix in fixed:
        if vocab is None:
            continue
        if given is not None and given != vocab:
            raise VocabError(
                f"--vocab-size {given}: {whose} has a vocabulary of {vocab}; leave --vocab-size out"
            )
        _check_fits(data_vocab, vocab, data, f"{whose} has", fix)
        note = f"vocab {vocab}, {whose}'s (the preset's: {preset_vocab})"
        return Vocabulary(vocab, note if vocab != preset_vocab else "")
    fix = f"pass --vocab-size {data_vocab} (or more)"
    if given is not None:
        _check_fits(
            data_vocab, given, data, f"--vocab-size {given} gives", fix + " or leave it out"
        )
        note = f"vocab {given} from --vocab-size (the preset's: {preset_vocab})"
        return Vocabulary(given, note if given != preset_vocab else "")
    if data_vocab is not None and tokenizer not in (None, "bytes") and data_vocab != preset_vocab:
        return Vocabulary(
            data_vocab,
            f"the model takes the tokenizer's vocab {data_vocab} (the preset's: "
            f"{preset_vocab}; --vocab-size N sets another)",
        )
    _check_fits(data_vocab, preset_vocab, data, "the preset has", fix)
    return Vocabulary(preset_vocab)


def _check_fits(data_vocab: int | None, model_vocab: int, data: str, model: str, fix: str) -> None:
    """The data's ids (below ``data_vocab``) fit a model of ``model_vocab``, or one line
    naming both sizes, the ``model`` side and what works (``fix``)."""
    if data_vocab is not None and data_vocab > model_vocab:
        raise VocabError(
            f"--data {data} has a vocabulary of {data_vocab} (ids up to {data_vocab - 1}); "
            f"{model} a vocabulary of {model_vocab}: {fix}"
        )
