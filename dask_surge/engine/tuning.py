"""Every process-wide setting of a worker, declared once (``surge.tuning.*``; ``docs/tuning.md``).

A :class:`Setting` says what one setting does, its config key, the device types it was
measured on and its value per device type. ``auto`` (the shipped value of every key) takes
that declared value: on where it was measured, off elsewhere (on a GPU, a setting measured
only on a CPU stays off until a GPU run shows it helps; the GPU session keeps an arm for
each, ``docs/tuning.md``). ``true``/``false`` (or a number of processes) forces it.

Two scopes. A ``"process"`` setting changes the whole process (its allocator, its garbage
collector, an environment variable, distributed's profiler): only the worker plugin applies
it (:func:`apply_worker`), in a worker process of its own, so a user's own process keeps
its state unless the user forces the setting. An ``"engine"`` setting only changes how one
engine runs (its copy of a model, its tokenizer): it is read by :func:`setting` wherever
the engine runs.

A process setting that cannot be undone (``undoable=False``: the allocator, ``mallopt``)
applies on ``auto`` only on a worker that runs dask-surge only (``surge.dedicated-workers``,
which dask-surge's own clusters set in their workers); the others are undone when the worker
plugin leaves (:func:`release_worker`), so a user's cluster is left as it was found.

Examples
--------
>>> setting("allocator", "cpu"), setting("allocator", "cuda")
(True, False)
>>> import dask
>>> with dask.config.set({"surge.tuning.allocator": True}):
...     setting("allocator", "cuda")
True
>>> active("gc-pause")  # a user's own process: off until the worker plugin applies it
False
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import dask.config

from ..config import get as config_get
from ..errors import SurgeValueError
from ..options import Invalid, boolean, non_negative_int
from .allocator import keep_large_blocks

__all__ = [
    "SETTINGS",
    "Setting",
    "active",
    "apply_worker",
    "applied",
    "configured",
    "release_worker",
    "setting",
]

Scope = Literal["process", "engine"]


@dataclass(frozen=True)
class Setting:
    """One tuning setting.

    Attributes
    ----------
    name : str
        The key under ``surge.tuning.`` (``"gc-pause"``).
    does : str
        What it does, in one sentence.
    scope : {"process", "engine"}
        ``"process"``: applied by the worker plugin only; ``"engine"``: read where an engine runs.
    measured_on : tuple of str
        Device types a benchmark showed it helps on (``docs/ab_studies.md``).
    default : dict of str to object
        The value ``auto`` takes per device type (a type not listed takes ``default["other"]``).
    measured : str
        Where its measurement is written up (a section of ``docs/ab_studies.md``).
    numeric : bool
        True when the value is a count (``int >= 0``) rather than on/off.
    undoable : bool
        False for a process setting that cannot be undone (``mallopt``): ``auto`` applies it only on a
        worker that runs dask-surge only (``surge.dedicated-workers``).
    """

    name: str
    does: str
    scope: Scope
    measured_on: tuple[str, ...]
    default: Mapping[str, Any] = field(default_factory=dict)
    measured: str = ""
    numeric: bool = False
    undoable: bool = True

    @property
    def key(self) -> str:
        """The full config key, ``surge.tuning.<name>``."""
        return f"surge.tuning.{self.name}"

    def for_device(self, device_type: str) -> Any:
        """The value ``auto`` takes on ``device_type`` (``"cpu"``, ``"cuda"``, ``"mps"``)."""
        return self.default.get(device_type, self.default["other"])

    def check(self, value: Any) -> Any:
        """``value`` validated: ``"auto"``, a bool (or an int >= 0 for a count, None meaning ``"auto"``)."""
        if value == "auto" and isinstance(value, str):
            return value
        if self.numeric and value is None:
            return "auto"
        allowed = "'auto' or an int >= 0" if self.numeric else "'auto', True or False"
        try:  # the int and bool rules of the options (options.py), not restated here
            return (non_negative_int(allowed) if self.numeric else boolean(allowed))(value)
        except Invalid:
            pass
        env = "DASK_SURGE__TUNING__" + self.name.upper().replace("-", "_")
        raise SurgeValueError(
            f"{self.key}={value!r} is not allowed: it must be {allowed}. Fix: dask.config.set({{{self.key!r}: ...}}) "
            f"or the {env} environment variable ('auto' for the default of the device, or {allowed})."
        )


_CPU_ONLY = {"cpu": True, "other": False}

#: The settings, by name (the key under ``surge.tuning.``).
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "allocator",
            "keep activation blocks on the heap (glibc mallopt: mmap threshold 32 MiB, trim at "
            "twice that) instead of a fresh zero-filled mmap per block",
            "process",
            ("cpu",),
            _CPU_ONLY,
            "docs/ab_studies.md: Allocator (1.19x, MiniLM on CPU workers)",
            undoable=False,
        ),
        Setting(
            "gc-pause",
            "hold off Python's cyclic garbage collector during one tokenizer call (one GC-tracked "
            "object per text, no cycles), in the worker and its tokenizing helpers",
            "process",
            ("cpu",),
            _CPU_ONLY,
            "docs/ab_studies.md: Pause the garbage collector around tokenizing",
        ),
        Setting(
            "rayon-threads",
            "size the Rust tokenizer's thread pool (RAYON_NUM_THREADS) to the worker's share "
            "of its host's cores (a value already set is kept)",
            "process",
            ("cpu",),
            _CPU_ONLY,
            "docs/ab_studies.md: The Rust tokenizer's thread share",
        ),
        Setting(
            "pause-profiler",
            "pause distributed's profiler on a worker while it runs SuperBatch tasks (its "
            "stack walks take the GIL)",
            "process",
            ("cpu",),
            _CPU_ONLY,
            "docs/ab_studies.md: Distributed's worker profiler off",
        ),
        Setting(
            "cpu-kernels",
            "on a CPU, run the engine's copy of the model with linear layers through oneDNN on "
            "pre-packed weights (gelu fused) and attention on padded keys (your model object is left as it "
            "was)",
            "engine",
            ("cpu",),
            _CPU_ONLY,
            "docs/ab_studies.md: The encoder on a CPU (oneDNN linears)",
        ),
        Setting(
            "tokenize-processes",
            "helper processes per worker that tokenize, handing ids back through shared memory",
            "engine",
            (),
            {"other": 0},
            "docs/ab_studies.md: Tokenizing helper processes (the token pool)",
            numeric=True,
        ),
        Setting(
            "joined-tokenizing",
            "join texts into few tokenizer inputs (the same ids, far fewer Python "
            "objects), where the tokenizer allows it",
            "engine",
            ("cpu",),
            _CPU_ONLY,
            "docs/ab_studies.md: Joined tokenizing",
        ),
    )
}

#: name -> the value :func:`apply_worker` applied in this process (empty in a user's own process)
_applied: dict[str, Any] = {}


def _declared(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise SurgeValueError(
            f"unknown tuning setting {name!r}. Fix: use one of {sorted(SETTINGS)}."
        ) from None


def configured(name: str) -> Any:
    """The configured value of ``surge.tuning.<name>``, validated (``"auto"``, a bool or a count).

    Examples
    --------
    >>> configured("cpu-kernels")
    'auto'
    """
    opt = _declared(name)
    return opt.check(dask.config.get(opt.key, "auto"))


def setting(name: str, device: str = "cpu") -> Any:
    """The value of setting ``name`` on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``): as
    forced by the config, else (``auto``) as declared for that device type.

    Examples
    --------
    >>> setting("joined-tokenizing", "cpu"), setting("joined-tokenizing", "cuda:0")
    (True, False)
    >>> setting("tokenize-processes", "cuda")
    0
    >>> try:
    ...     setting("gc-paws")
    ... except SurgeValueError as err:
    ...     print(str(err)[:58])
    unknown tuning setting 'gc-paws'. Fix: use one of ['alloca
    """
    value = configured(name)
    if value == "auto":
        return SETTINGS[name].for_device(str(device).split(":")[0])
    return value


def active(name: str) -> bool:
    """Whether process setting ``name`` is on in this process: forced by the config, else as the
    worker plugin applied it here (off in a user's own process, where nothing applied it).

    Examples
    --------
    >>> import dask
    >>> with dask.config.set({"surge.tuning.gc-pause": True}):  # asked for: on in any process
    ...     active("gc-pause")
    True
    """
    value = configured(name)
    if value == "auto":
        return bool(_applied.get(name, False))
    return bool(value)


def applied() -> dict[str, Any]:
    """The process settings :func:`apply_worker` applied in this process (a copy; empty if none)."""
    return dict(_applied)


def apply_worker(device: str) -> dict[str, bool]:
    """Apply the process settings in this worker process, for a worker that encodes on ``device``.

    Only :class:`~dask_surge.execution.plugins.EncoderPlugin` calls it, in a worker process of its
    own. The allocator takes effect here, on ``auto`` only where ``surge.dedicated-workers`` is
    on in this worker's config (it cannot be undone); the others are recorded, for :func:`active`
    to read where they apply (the tokenizer's threads when the model loads, the garbage collector
    pause around each tokenizer call, the profiler pause around SuperBatch tasks), until
    :func:`release_worker`.

    Parameters
    ----------
    device : str
        The device the worker's model runs on.

    Returns
    -------
    dict of str to bool
        Name -> whether it is on (``allocator``: whether the allocator took the setting).

    Examples
    --------
    >>> apply_worker("cpu")  # in a worker: EncoderPlugin.setup calls it  # doctest: +SKIP
    {'allocator': True, 'gc-pause': True, 'rayon-threads': True, 'pause-profiler': True}
    """
    dedicated = bool(config_get("dedicated-workers"))
    done = {
        opt.name: bool(setting(opt.name, device))
        and (opt.undoable or dedicated or configured(opt.name) != "auto")
        for opt in SETTINGS.values()
        if opt.scope == "process"
    }
    if done["allocator"]:
        done["allocator"] = keep_large_blocks()
    _applied.update(done)
    return done


def release_worker() -> dict[str, Any]:
    """Undo what :func:`apply_worker` recorded in this process, once no worker plugin needs it: the
    settings :func:`active` reads are off again (the allocator, which cannot be undone, stays
    recorded as it was applied).

    Returns
    -------
    dict
        What stays applied (``{"allocator": True}`` where it was, else empty).

    Examples
    --------
    >>> release_worker()  # a user's own process: nothing was applied
    {}
    """
    for name, value in list(_applied.items()):
        if SETTINGS[name].undoable or not value:  # what cannot be undone stays recorded where it applied
            del _applied[name]
    return dict(_applied)
