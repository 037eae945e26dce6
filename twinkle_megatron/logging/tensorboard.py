"""TensorBoard scalars and hparams, through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package).

A run that starts at step *s* must not show the points an earlier run wrote
at steps ≥ *s* into the same directory. TensorBoard's own mechanism, a
``SessionLog.START`` event at *s* (``SummaryWriter(purge_step=s)``), is honoured
fully by ``EventAccumulator`` only: the app's legacy loader ignores the first
START of a run, and its data server purges a tag only when that tag is logged
again (an eval point at step 15 of the abandoned run stays when the resumed run
has not evaluated yet). So before writing, this backend also removes those
events from the event files (each rewritten atomically with TensorBoard's own
record reader and writer; files without such events are left untouched), and
writes the START marker, which a TensorBoard already running keeps honouring
for the data it has loaded. Every loader then shows each step once.

The run's configuration is written once as TensorBoard hparams (flattened keys,
``parallel.tp``...); the configuration of an earlier run in the directory is
replaced. Scalars are stored as float32 by TensorBoard: counters above 2**24
(``train/consumed_tokens``) are exact in JSONL, W&B, MLflow and SwanLab only.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Mapping

from .base import Backend, RunStart, flatten_config

# The summaries torch's hparams() writes; an earlier run's are replaced by this run's.
_CONFIG_TAGS = ("_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info")


class TensorBoardBackend(Backend):
    """One scalar per key and log step, in ``log_dir``."""

    name = "tensorboard"
    requires = ("tensorboard",)  # what torch.utils.tensorboard imports
    pip_extra = "tensorboard"

    def __init__(self, log_dir: str, flush_every_write: bool = True) -> None:
        self.log_dir = log_dir
        self.flush_every_write = flush_every_write
        self._writer: Any = None

    def open(self, run: RunStart) -> None:
        from torch.utils.tensorboard import SummaryWriter  # raises ImportError without tensorboard

        config = _hparam_values(flatten_config(run.config))
        drop_superseded_events(self.log_dir, run.first_step, drop_config=bool(config))
        self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=run.first_step)
        if config:
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(config, {}):
                self._writer.file_writer.add_summary(summary, global_step=run.first_step)
            self._writer.flush()

    def write(self, record: Mapping[str, float], step: int) -> None:
        for key, value in record.items():
            self._writer.add_scalar(key, value, global_step=step)
        if self.flush_every_write:  # once per log step: cheap, and a crash loses nothing
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def drop_superseded_events(log_dir: str, first_step: int, drop_config: bool = False) -> int:
    """Remove from ``log_dir``'s event files the summaries and session markers at ``first_step`` or later.

    With ``drop_config``, the hparams summaries of any step go too (a new
    configuration follows). Returns how many events were removed. A truncated
    last record (a killed writer) is dropped with the file's rewrite.
    """
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    removed = 0
    for path in sorted(glob.glob(os.path.join(glob.escape(log_dir), "events.out.tfevents.*"))):
        kept, dropped = [], 0
        for raw in RawEventFileLoader(path).Load():
            event = Event.FromString(raw)
            superseded = (event.HasField("summary") or event.HasField("session_log")) and event.step >= first_step
            config = drop_config and event.HasField("summary") and any(
                value.tag in _CONFIG_TAGS for value in event.summary.value)
            if superseded or config:
                dropped += 1
            else:
                kept.append(raw)
        if not dropped:
            continue
        temporary = path + ".tmp"
        writer = RecordWriter(open(temporary, "wb"))
        for raw in kept:
            writer.write(raw)
        writer.close()
        os.replace(temporary, path)
        removed += dropped
    return removed


def _hparam_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """TensorBoard hparams take numbers, strings and bools; anything else is shown as its text."""
    values: dict[str, Any] = {}
    for key, value in config.items():
        if value is None:
            continue
        values[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return values
