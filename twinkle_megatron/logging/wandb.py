"""Weights & Biases: one run per training; a restarted job continues it on every W&B server, losing no step.

Which run:

* a run the user already started (``wandb.run``) is logged into, with the run
  configuration added to its config; the tracker never finishes it (a restart
  cannot rewind it: W&B drops the repeated steps);
* a run that continues (it starts after step 1, or ``SLURM_RESTART_COUNT`` > 0,
  or the tracker loaded a checkpoint after it logged) continues the run before
  it: ``run_id``, else ``$WANDB_RUN_ID``, else the id recorded in
  ``LOG_DIR/run_ids.json`` (see *Restarts* below);
* otherwise a new run: W&B's own fresh id, or ``run_id`` / ``$WANDB_RUN_ID``
  when given (``resume="allow"``). Two trainings in one allocation are two runs.

Restarts (a run that continues at step *s*), in this order:

1. **Rewind** (``resume_from="ID?_step=s-1"``), with ``rewind=True``, and by
   default online: W&B archives the points after *s* − 1 and the run logs those
   steps again, once. Rewind is a preview feature of W&B's cloud (on request)
   and missing on self-managed servers: when ``wandb.init`` refuses it (any
   error), the next steps apply, with one warning. Offline, the rewind is only
   recorded and applied when synced, when nothing can fall back any more: so
   offline the default (``rewind=None``) is not to rewind.
2. **Resume** (``resume="allow"``, same id) when the run holds no point at *s*
   or later (it stopped at its checkpoint): W&B appends, nothing to supersede.
3. **Successor**: a new run with the same name and tags, the run
   configuration and ``twinkle_megatron.continues = OLD_ID`` in its config,
   receives the points before *s* (read from the earlier run's local folders
   with W&B's own reader, else from the server's API), then logs from *s* on.
   Offline, the earlier run's folders move to ``wandb/superseded/``, so that
   ``wandb sync wandb/`` uploads one run holding every step once; online, the
   earlier run is tagged ``superseded`` when the API is reachable. Its id is
   recorded for the next restart.

A restart never disables the backend: only a ``wandb.init`` that fails for a
new run does. The run's configuration (layout, model shape, batch, FLOPs,
versions, and the user's ``config``) goes to the run's config once.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Mapping, Optional

from . import wandb_history
from .base import RunStart
from .run_backends import ResumableRunBackend

SUPERSEDED_TAG = "superseded"
OFFLINE_MODES = ("offline", "dryrun")


class WandbBackend(ResumableRunBackend):
    """Logs to a W&B run (see the module docstring for which one, and for ``rewind``).

    Args:
        rewind: ``True``: rewind a continued run first; ``False``: never (servers
            without rewind); ``None`` (default): online only.
    """

    name = "wandb"
    requires = ("wandb",)
    pip_extra = "wandb"

    def __init__(self, project: Optional[str] = None, name: Optional[str] = None, run_id: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None, directory: Optional[str] = None,
                 rewind: Optional[bool] = None, **init_kwargs: Any) -> None:
        super().__init__(config, run_id)
        self.project = project or os.environ.get("WANDB_PROJECT", "twinkle-megatron")
        self.run_name = name
        self.directory = directory
        self.rewind = rewind
        self.init_kwargs = init_kwargs

    def given_run_id(self) -> Optional[str]:
        return self.run_id or os.environ.get("WANDB_RUN_ID")

    def user_run(self) -> Optional[Any]:
        import wandb

        return wandb.run

    def add_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def open_own_run(self, run: RunStart, config: dict[str, Any], previous: Optional[str]) -> None:
        import wandb

        options: dict[str, Any] = {"project": self.project, "name": self.run_name, "config": config,
                                   "dir": self.directory, **self.init_kwargs}
        if options.get("dir"):
            os.makedirs(options["dir"], exist_ok=True)
        if previous is not None and run.continues:
            self._continue(wandb, previous, run.first_step, options)
        else:
            if previous is not None:
                options.update(id=previous, resume="allow")
            self.start(_init(wandb, options))

    def finish_failed(self) -> None:
        self.run.finish(exit_code=1)

    # ------------------------------------------------------------ restarts

    def _continue(self, wandb: Any, previous: str, first_step: int, options: dict[str, Any]) -> None:
        with _rewind_over_resume_env():  # W&B reads the environment once, at its setup: maybe here
            offline = (options.get("mode") or wandb.setup().settings.mode) in OFFLINE_MODES
        refused = None
        if self.rewind or (self.rewind is None and not offline):
            try:
                with _rewind_over_resume_env():
                    self.start(_init(wandb, {**options, "resume_from": f"{previous}?_step={max(first_step - 1, 0)}"}))
                return
            except Exception as error:  # noqa: BLE001 - any refusal: fall back, never disable the backend
                refused = f"W&B did not rewind run {previous} ({type(error).__name__}: {error})"
        wandb_dir = os.path.join(options.get("dir") or os.environ.get("WANDB_DIR") or os.getcwd(), "wandb")
        folders = wandb_history.run_folders(wandb_dir, previous)
        last = wandb_history.last_step(folders, previous) if folders else \
            _server_last_step(wandb, options, previous, offline)
        if last is not None and last < first_step:
            self.start(_init(wandb, {**options, "id": previous, "resume": "allow"}))
            if refused:
                _warn(f"{refused}; it holds no step from {first_step} on, so it is resumed (resume='allow')")
            return
        self._succeed(wandb, previous, first_step, options, folders, refused, offline)
        if offline and folders:
            wandb_history.move_aside(wandb_dir, folders)

    def _succeed(self, wandb: Any, previous: str, first_step: int, options: dict[str, Any], folders: list[str],
                 refused: Optional[str], offline: bool) -> None:
        """Start the successor of ``previous`` and copy the points before ``first_step`` into it."""
        earlier = wandb_history.run_record(folders[0]) if folders else {}
        tags = [*(earlier.get("tags") or ()), *(options.get("tags") or ())]
        config = {**options["config"], "twinkle_megatron": {"continues": previous}}
        successor = {**options, "config": config, "tags": list(dict.fromkeys(tags)) or None,
                     "name": options.get("name") or earlier.get("display_name")}
        self.start(_init(wandb, successor))
        if folders:
            points, source = wandb_history.visible_points(folders, previous, below=first_step), "its local files"
        elif offline:
            points, source = iter(()), None
        else:
            points, source = _server_points(wandb, self.run, previous, first_step), "W&B's server"
        copied, failure = 0, None
        try:
            for step, values in points:
                self.run.log(values, step=step)
                copied += 1
        except Exception as error:  # noqa: BLE001 - the successor logs on without them
            failure = f"{type(error).__name__}: {error}"
        marked = "" if offline else _mark_superseded(wandb, self.run, previous)
        if refused or failure or source is None or marked.startswith("; not"):
            missing = ("; its earlier steps could not be copied (offline, and none of its run folders is here)"
                       if source is None else f"; copying stopped after {copied} step(s): {failure}" if failure
                       else f" with {copied} earlier step(s) copied from {source}")
            _warn(f"{refused or f'run {previous} is not rewound'}; it holds steps from {first_step} on, so run "
                  f"{self.run.id} continues it (config twinkle_megatron.continues = {previous!r}){missing}{marked}")


def _init(wandb: Any, options: Mapping[str, Any]) -> Any:
    """``wandb.init`` with the options that are set; a run a failed init left behind is finished."""
    try:
        return wandb.init(**{key: value for key, value in options.items() if value is not None})
    except Exception:
        if wandb.run is not None:
            with contextlib.suppress(Exception):
                wandb.run.finish(exit_code=1)
        raise


def _server_run(wandb: Any, options: Mapping[str, Any], run_id: str) -> Any:
    entity = options.get("entity") or os.environ.get("WANDB_ENTITY")
    api = wandb.Api(overrides={"entity": entity} if entity else {})
    return api.run(f"{entity or api.default_entity}/{options.get('project')}/{run_id}")


def _server_last_step(wandb: Any, options: Mapping[str, Any], run_id: str, offline: bool) -> Optional[int]:
    """The last step the server holds for ``run_id`` (None when unknown: offline, or unreachable)."""
    if offline:
        return None
    try:
        return int(_server_run(wandb, options, run_id).lastHistoryStep)
    except Exception:  # noqa: BLE001 - unknown: a successor is the safe choice
        return None


def _server_points(wandb: Any, run: Any, run_id: str, first_step: int) -> Iterator[tuple[int, dict]]:
    """The points of ``run_id`` before ``first_step``, from the server's API."""
    earlier = _server_run(wandb, {"entity": run.entity, "project": run.project}, run_id)
    for row in earlier.scan_history(min_step=0, max_step=first_step):
        step = row.get("_step")
        values = {key: value for key, value in row.items()
                  if not key.startswith("_") and isinstance(value, (int, float)) and value is not None}
        if step is not None and step < first_step and values:
            yield int(step), values


def _mark_superseded(wandb: Any, run: Any, run_id: str) -> str:
    """Tag the earlier run ``superseded`` on the server; a note for the warning."""
    try:
        earlier = _server_run(wandb, {"entity": run.entity, "project": run.project}, run_id)
        earlier.tags = [*earlier.tags, SUPERSEDED_TAG]
        earlier.update()
    except Exception as error:  # noqa: BLE001 - a label only
        return f"; not tagged {SUPERSEDED_TAG!r}: run {run_id} ({type(error).__name__}: {error})"
    return ""


def _warn(message: str) -> None:
    warnings.warn(f"W&B restart: {message}", RuntimeWarning, stacklevel=4)


@contextlib.contextmanager
def _rewind_over_resume_env() -> Iterator[None]:
    """Hide ``$WANDB_RESUME`` from ``wandb.init`` while rewinding.

    Job scripts often export ``WANDB_RESUME=allow``; W&B refuses ``resume`` together
    with ``resume_from`` (they are mutually exclusive), so the rewind, which is the
    resume done right, would be refused. Restored right after the call.
    """
    saved = os.environ.pop("WANDB_RESUME", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["WANDB_RESUME"] = saved
