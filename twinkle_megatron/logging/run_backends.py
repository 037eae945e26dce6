"""What the W&B and SwanLab backends share: which run ``open`` logs into, and remembering its id.

``open`` (:meth:`ResumableRunBackend.open`), for a tracking service whose runs
are continued by id:

1. the run configuration is the tracker's (``RunStart.config``) updated with
   the backend's own ``config``;
2. a run the user already started is adopted (logged into, its config updated,
   never finished by the tracker);
3. otherwise the id of the run to continue is, first that applies: the run
   this backend opened last, on a restart in the same process; the id given
   (``run_id``, or the service's environment variable); the id recorded in
   ``LOG_DIR/run_ids.json``, when the run continues (:mod:`.run_ids`); none
   (a new run);
4. the service opens its own run with that id (the subclass's
   :meth:`~ResumableRunBackend.open_own_run`: how a continued run supersedes
   its abandoned points differs by service), and the id of the run it opened
   is recorded for the next restart.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .base import ExperimentBackend, RunStart
from .run_ids import recall_run_id, remember_run_id


class ResumableRunBackend(ExperimentBackend):
    """An :class:`ExperimentBackend` whose runs are continued by id (see the module docstring)."""

    def __init__(self, config: Optional[Mapping[str, Any]] = None, run_id: Optional[str] = None) -> None:
        super().__init__(config)
        self.run_id = run_id
        self.last_run_id: Optional[str] = None  # the run this backend opened last (a restart in-process continues it)

    def open(self, run: RunStart) -> None:
        config = {**run.config, **self.config}
        users_run = self.user_run()
        if users_run is not None:  # the user's run: log into it, never finish it
            self.adopt(users_run)
            self.add_config(config)
            return
        previous = (self.last_run_id if run.restart else None) or self.given_run_id() or \
            (recall_run_id(run.log_dir, self.name) if run.continues else None)
        self.open_own_run(run, config, previous)
        self.last_run_id = self.run.id
        remember_run_id(run.log_dir, self.name, self.run.id)

    def given_run_id(self) -> Optional[str]:
        """The id to continue given by the user: ``run_id`` (a service may also read its environment)."""
        return self.run_id

    def user_run(self) -> Optional[Any]:
        """The run the user already started in this process, or None."""
        raise NotImplementedError

    def add_config(self, config: Mapping[str, Any]) -> None:
        """Add the run configuration to the adopted run's config."""
        raise NotImplementedError

    def open_own_run(self, run: RunStart, config: dict[str, Any], previous: Optional[str]) -> None:
        """Open (:meth:`start`) the backend's own run, continuing run ``previous`` when it is not None."""
        raise NotImplementedError
