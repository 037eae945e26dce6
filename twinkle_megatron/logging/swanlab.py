"""SwanLab: one experiment per run."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .base import Backend


class SwanLabBackend(Backend):
    """Logs to a SwanLab experiment; ``run_id`` with ``resume="allow"`` continues an existing one."""

    name = "swanlab"

    def __init__(self, project: Optional[str] = None, experiment_name: Optional[str] = None,
                 run_id: Optional[str] = None, config: Optional[Mapping[str, Any]] = None,
                 **init_kwargs: Any) -> None:
        self.project = project
        self.experiment_name = experiment_name
        self.run_id = run_id
        self.config = dict(config) if config is not None else None
        self.init_kwargs = init_kwargs
        self._swanlab: Any = None

    def open(self, resume_step: Optional[int]) -> None:
        import swanlab

        options = {"project": self.project, "experiment_name": self.experiment_name, "config": self.config,
                   **self.init_kwargs}
        if self.run_id is not None:
            options.update(id=self.run_id, resume="allow")
        swanlab.init(**{key: value for key, value in options.items() if value is not None})
        self._swanlab = swanlab

    def write(self, record: Mapping[str, float], step: int) -> None:
        self._swanlab.log(dict(record), step=step)

    def close(self) -> None:
        if self._swanlab is not None:
            self._swanlab.finish()
            self._swanlab = None
