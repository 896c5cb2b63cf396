"""Warnings other libraries print while autopar traces a model that tell its user nothing: filtered there only.

    with known_noise_filtered():
        ep = torch.export.export(model, ...)
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

# (logger, start of the message). transformers warns on the first forward of a model class with no loss type of
# its own (GPT2LMHeadModel, from `from_pretrained` or a config) that it uses the causal-LM loss, which is the
# loss such a model computes: tracing runs that forward, so every command on such a model would print it.
KNOWN_NOISE = (("transformers.modeling_utils", "`loss_type=None` was set in the config but it is unrecognized"),)


class _Drop(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


@contextlib.contextmanager
def known_noise_filtered() -> Iterator[None]:
    filters = [(logging.getLogger(name), _Drop(start)) for name, start in KNOWN_NOISE]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
