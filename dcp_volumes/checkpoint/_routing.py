"""Routing: make ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` use dcp_volumes for chosen URLs.

DCP picks a storage writer or reader for ``checkpoint_id=`` from a fixed list
(``FileSystemWriter``, ``FsspecWriter``) and has no plug-in registry. ``route()``
is the opt-in, reversible way to send some URL prefixes to ``VolumeWriter`` /
``VolumeReader`` without changing training code::

    import dcp_volumes
    dcp_volumes.route(["s3://bucket/"], storage_options={"endpoint_url": ...})
    dcp.save(state, checkpoint_id="s3://bucket/run1/step-100")   # VolumeWriter
    dcp.load(state, checkpoint_id="s3://bucket/run1/step-100")   # VolumeReader
    dcp.save(state, checkpoint_id="/tmp/ckpt")                   # not routed: stock DCP
    dcp_volumes.unroute()                                        # everything back

What it changes, exactly: while at least one route is active, six public names
are replaced by thin wrappers of the originals (``functools.wraps``: same
signature and docstring, the original in ``__wrapped__``):

* ``torch.distributed.checkpoint.save``, ``.async_save`` and ``.load``;
* ``torch.distributed.checkpoint.state_dict_saver.save`` and ``.async_save``;
* ``torch.distributed.checkpoint.state_dict_loader.load``.

A wrapper acts only when the call passes ``checkpoint_id`` *and no*
``storage_writer`` / ``storage_reader``, and the id starts with a routed prefix
(the longest matching prefix wins); it then builds a ``VolumeWriter`` /
``VolumeReader`` for the id with that route's options and calls the original
with it (and ``checkpoint_id=None``: DCP then logs the writer's or reader's id,
which shows no credentials). Every other call goes to the original untouched. No private torch
attribute is read or patched. References taken *before* routing
(``from torch.distributed.checkpoint import save`` at import time, a
``functools.partial`` of ``dcp.save``) keep calling the stock function;
references taken while routing is on keep the wrapper, which falls through to
stock DCP once the last route is removed. ``unroute()`` (or leaving the
``with route(...)`` block, or ``Routing.remove()``) restores the original
functions, except where someone else replaced a name after us: that name is
left to them (a warning says so) and our wrapper under it passes everything
through.

Routed saves use ``overwrite=True`` unless configured otherwise, as stock
``FileSystemWriter`` / ``FsspecWriter`` do, so training code that saves to
the same ``checkpoint_id`` twice keeps working; the commit stays safe
(``.metadata`` of the old checkpoint goes first, the new one is written last).

Defaults come from one place, in this order (later wins): the library's
defaults; the environment (``DCP_VOLUMES_STAGING``, ``DCP_VOLUMES_STORAGE_OPTIONS``);
the config file's top level; its ``[routes."<prefix>"]`` table; the arguments of
``route()``. The prefixes come from ``route()``'s argument, else from the config
file (``prefixes`` and the ``routes`` keys), else from ``DCP_VOLUMES_ROUTE``. The
config file is ``route(config=...)`` or ``DCP_VOLUMES_ROUTE_CONFIG``; TOML, or
JSON when its name ends in ``.json``::

    staging_dir = "/nvme/dcp-staging"
    upload_concurrency = 16
    read_concurrency = 32
    prefixes = ["az://ckpt/"]

    [routes."s3://bucket/"]
    storage_options = { endpoint_url = "http://127.0.0.1:9000", key = "...", secret = "..." }
    writer_options = { part_size = "64MiB" }
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType, TracebackType
from typing import Any

from dcp_volumes import _env
from dcp_volumes._exceptions import ConfigurationError
from dcp_volumes._volume import redact_options, redact_url
from dcp_volumes.checkpoint._reader import VolumeReader
from dcp_volumes.checkpoint._writer import VolumeWriter

logger = logging.getLogger(__name__)

__all__ = ["Route", "Routing", "active_routes", "route", "unroute"]

# (module, name, kind): the public names replaced while routing is on.
TARGETS: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed.checkpoint", "save", "save"),
    ("torch.distributed.checkpoint", "async_save", "async_save"),
    ("torch.distributed.checkpoint", "load", "load"),
    ("torch.distributed.checkpoint.state_dict_saver", "save", "save"),
    ("torch.distributed.checkpoint.state_dict_saver", "async_save", "async_save"),
    ("torch.distributed.checkpoint.state_dict_loader", "load", "load"),
)

# Keys of a config level (the file's top level or one [routes."<prefix>"] table).
_OPTION_KEYS = frozenset(
    {"storage_options", "staging_dir", "upload_concurrency", "read_concurrency", "overwrite",
     "writer_options", "reader_options"}
)
_TOP_KEYS = _OPTION_KEYS | {"prefixes", "routes"}
# Options route() sets itself; writer_options/reader_options must not name them twice.
_WRITER_OWN = frozenset({"path", "staging_dir", "storage_options", "upload_concurrency",
                         "overwrite"})
_READER_OWN = frozenset({"path", "storage_options", "read_concurrency"})


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Route:
    """One routed URL prefix and the options of the writers and readers made for it.

    Attributes:
        prefix: ``s3://bucket/``, ``az://``, ``/mnt/ckpt``...: a ``checkpoint_id``
            equal to it or below it (at a ``/`` boundary) is routed.
        storage_options: passed to ``VolumeWriter`` / ``VolumeReader``.
        staging_dir: the writers' staging dir (``None``: ``DCP_VOLUMES_STAGING`` or a temp dir).
        upload_concurrency: the writers' ``upload_concurrency`` (``None``: its default).
        read_concurrency: the readers' ``read_concurrency`` (``None``: its default).
        overwrite: the writers' ``overwrite`` (``True`` as in stock DCP's writers).
        writer_options: further ``VolumeWriter`` keyword arguments.
        reader_options: further ``VolumeReader`` keyword arguments.
    """

    prefix: str
    storage_options: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))
    staging_dir: str | None = None
    upload_concurrency: int | None = None
    read_concurrency: int | None = None
    overwrite: bool = True
    writer_options: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))
    reader_options: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix.strip():
            raise ConfigurationError(
                f"A route prefix must be a non-empty URL or path prefix such as 's3://bucket/', "
                f"not {self.prefix!r}."
            )
        for name in ("storage_options", "writer_options", "reader_options"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise ConfigurationError(
                    f"Route {redact_url(self.prefix)!r}: {name} must be a mapping (a dict or "
                    f"a TOML table), not {type(value).__name__}."
                )
            object.__setattr__(self, name, _frozen(value))
        for name in ("upload_concurrency", "read_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigurationError(
                    f"Route {redact_url(self.prefix)!r}: {name}={value!r} must be an integer >= 1."
                )
        if not isinstance(self.overwrite, bool):
            raise ConfigurationError(
                f"Route {redact_url(self.prefix)!r}: overwrite={self.overwrite!r} must be true "
                "or false."
            )
        _check_keywords(self.prefix, "writer_options", self.writer_options, VolumeWriter,
                        _WRITER_OWN)
        _check_keywords(self.prefix, "reader_options", self.reader_options, VolumeReader,
                        _READER_OWN)

    def __repr__(self) -> str:
        # Not the dataclass repr: storage_options hold credentials (redact_options' rule).
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "prefix":
                value = redact_url(value)
            elif isinstance(value, Mapping):
                value = redact_options(value)
            shown.append(f"{f.name}={value!r}")
        return f"Route({', '.join(shown)})"

    def matches(self, checkpoint_id: str) -> bool:
        """Whether ``checkpoint_id`` is this prefix or lies below it."""
        prefix = self.prefix
        if checkpoint_id == prefix or checkpoint_id == prefix.rstrip("/"):
            return True
        boundary = prefix if prefix.endswith(("/", ":")) else prefix + "/"
        return checkpoint_id.startswith(boundary)

    def writer(self, checkpoint_id: str | os.PathLike[str]) -> VolumeWriter:
        """A ``VolumeWriter`` for ``checkpoint_id`` with this route's options."""
        kwargs: dict[str, Any] = dict(self.writer_options)
        if self.upload_concurrency is not None:
            kwargs["upload_concurrency"] = self.upload_concurrency
        return VolumeWriter(
            checkpoint_id,
            staging_dir=self.staging_dir,
            storage_options=dict(self.storage_options),
            overwrite=self.overwrite,
            **kwargs,
        )

    def reader(self, checkpoint_id: str | os.PathLike[str]) -> VolumeReader:
        """A ``VolumeReader`` for ``checkpoint_id`` with this route's options."""
        kwargs: dict[str, Any] = dict(self.reader_options)
        if self.read_concurrency is not None:
            kwargs["read_concurrency"] = self.read_concurrency
        return VolumeReader(checkpoint_id, storage_options=dict(self.storage_options), **kwargs)


def _check_keywords(
    prefix: str, what: str, options: Mapping[str, Any], cls: type, own: frozenset[str]
) -> None:
    params = inspect.signature(cls).parameters
    accepted = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for key in options:
        if key in own:
            raise ConfigurationError(
                f"Route {redact_url(prefix)!r}: {what} sets {key!r}, which the route sets "
                f"itself; give it as the route's own option ({key} = ...) instead."
            )
        if key not in accepted:
            raise ConfigurationError(
                f"Route {redact_url(prefix)!r}: {what} has {key!r}, which {cls.__name__} does "
                f"not take. It takes: {', '.join(sorted(accepted - own))}."
            )


class Routing:
    """The routes added by one ``route()`` call; a context manager that removes them.

    Use ``with dcp_volumes.route(...):`` for a block, or keep the handle and call
    ``remove()``; ``unroute()`` removes every route at once.
    """

    def __init__(self, routes: Sequence[Route]) -> None:
        self._routes = tuple(routes)

    @property
    def routes(self) -> tuple[Route, ...]:
        """The routes this handle added."""
        return self._routes

    def remove(self) -> None:
        """Remove this handle's routes; the last route gone restores torch's functions."""
        _TABLE.remove(self._routes)

    def __enter__(self) -> Routing:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Routing({[redact_url(r.prefix) for r in self._routes]!r})"


class _RouteTable:
    """The active routes and the wrappers installed in torch's namespace (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routes: tuple[Route, ...] = ()
        # (module, name) -> (original function, our wrapper) for the installed wrappers.
        self._installed: dict[tuple[str, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}

    @property
    def routes(self) -> tuple[Route, ...]:
        return self._routes

    def match(self, checkpoint_id: Any) -> Route | None:
        """The route of ``checkpoint_id`` (longest prefix), or ``None``."""
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return None
        text = os.fspath(checkpoint_id)
        if not isinstance(text, str):
            return None
        found = [r for r in self._routes if r.matches(text)]
        return max(found, key=lambda r: len(r.prefix)) if found else None

    def add(self, routes: Sequence[Route]) -> None:
        with self._lock:
            # A prefix routed again takes the new options.
            new = {r.prefix for r in routes}
            self._routes = tuple(r for r in self._routes if r.prefix not in new) + tuple(routes)
            self._install()
        logger.info("dcp_volumes routing on for %s",
                    ", ".join(redact_url(r.prefix) for r in routes))

    def remove(self, routes: Sequence[Route] | None) -> None:
        with self._lock:
            if routes is None:
                self._routes = ()
            else:
                gone = {id(r) for r in routes}
                self._routes = tuple(r for r in self._routes if id(r) not in gone)
            if not self._routes:
                self._uninstall()

    def _install(self) -> None:
        for module_name, name, kind in TARGETS:
            module = importlib.import_module(module_name)
            if (module_name, name) in self._installed:
                stock, _ = self._installed[(module_name, name)]
                if getattr(module, name) is not stock:
                    continue  # our wrapper, or someone's over it
                # Whoever wrapped ours put the stock function back: wrap it again.
                del self._installed[(module_name, name)]
            original = getattr(module, name)
            wrapper = _wrap(original, kind, self)
            setattr(module, name, wrapper)
            self._installed[(module_name, name)] = (original, wrapper)

    def _uninstall(self) -> None:
        for (module_name, name), (original, wrapper) in list(self._installed.items()):
            module = importlib.import_module(module_name)
            if getattr(module, name) is wrapper:
                setattr(module, name, original)
                del self._installed[(module_name, name)]
            else:
                # Someone wrapped it after us: removing theirs would be worse. Ours,
                # under theirs, passes everything through now the table is empty.
                logger.warning(
                    "unroute: %s.%s was replaced by someone else after dcp_volumes routed it; "
                    "left in place (routing is off: it passes every call to stock DCP)",
                    module_name, name,
                )


_TABLE = _RouteTable()


def _wrap(original: Callable[..., Any], kind: str, table: _RouteTable) -> Callable[..., Any]:
    """The routing wrapper of ``original`` (``dcp.save``, ``dcp.async_save`` or ``dcp.load``)."""
    if kind == "load":

        @functools.wraps(original)
        def load(*args: Any, **kwargs: Any) -> Any:
            chosen = None if kwargs.get("storage_reader") is not None else table.match(
                kwargs.get("checkpoint_id")
            )
            if chosen is not None:
                reader = chosen.reader(kwargs["checkpoint_id"])
                # The reader points at the id; DCP (and its logger) then take the
                # reader's checkpoint_id, which shows no credentials.
                kwargs["storage_reader"], kwargs["checkpoint_id"] = reader, None
                logger.debug("dcp.load of %s routed to VolumeReader", reader.checkpoint_id)
            return original(*args, **kwargs)

        return load

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        chosen = None if kwargs.get("storage_writer") is not None else table.match(
            kwargs.get("checkpoint_id")
        )
        if chosen is None:
            return original(*args, **kwargs)
        writer = chosen.writer(kwargs["checkpoint_id"])
        # As for load: DCP and its logger take the writer's id (no credentials).
        kwargs["storage_writer"], kwargs["checkpoint_id"] = writer, None
        logger.debug("dcp.%s of %s routed to VolumeWriter", kind, writer.checkpoint_id)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            writer.close()
            raise
        if kind == "save":
            writer.close()
            return result
        # async_save: the writer (also the stager) is ours to close once the upload is
        # done; torch >= 2.9 may return an AsyncSaveResponse holding that future.
        upload = getattr(result, "upload_completion", result)
        upload.add_done_callback(lambda _fut: writer.close())
        return result

    return save


# -- configuration ----------------------------------------------------------------------------


def _read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    text_path = os.fspath(path)
    try:
        with open(text_path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigurationError(
            f"Cannot read the routing config {text_path}: {exc.strerror or exc}. Fix the path "
            f"given to route(config=...) or in {_env.ROUTE_CONFIG}."
        ) from exc
    try:
        doc = json.loads(raw) if text_path.endswith(".json") else _toml().loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "JSON" if text_path.endswith(".json") else "TOML"
        raise ConfigurationError(
            f"The routing config {text_path} is not valid {kind}: {exc}. Fix the file (TOML, "
            "or JSON when the name ends in .json)."
        ) from exc
    if not isinstance(doc, dict):
        raise ConfigurationError(f"The routing config {text_path} must be a table/object.")
    _check_level(doc, _TOP_KEYS, text_path)
    routes = doc.get("routes", {})
    if not isinstance(routes, dict):
        raise ConfigurationError(
            f"{text_path}: 'routes' must be a table of prefix -> options, e.g. "
            '[routes."s3://bucket/"].'
        )
    for prefix, level in routes.items():
        if not isinstance(level, dict):
            raise ConfigurationError(f"{text_path}: routes.{prefix!r} must be a table.")
        _check_level(level, _OPTION_KEYS, f"{text_path} [routes.{prefix!r}]")
    prefixes = doc.get("prefixes", [])
    if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
        raise ConfigurationError(f"{text_path}: 'prefixes' must be a list of strings.")
    return doc


def _toml() -> Any:
    """The TOML parser: ``tomllib`` (Python >= 3.11), else the ``tomli`` package."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # pragma: no cover - Python 3.10
        import tomli
    except ImportError:
        raise ConfigurationError(
            "A TOML routing config needs Python >= 3.11 or the tomli package. Fix: "
            "pip install tomli, or write the config as JSON (a file name ending in .json)."
        ) from None
    return tomli


def _check_level(level: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(level) - allowed)
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}. Known: "
            f"{', '.join(sorted(allowed))}."
        )


def route(
    prefixes: str | Sequence[str] | Mapping[str, Mapping[str, Any]] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    upload_concurrency: int | None = None,
    read_concurrency: int | None = None,
    overwrite: bool | None = None,
    writer_options: Mapping[str, Any] | None = None,
    reader_options: Mapping[str, Any] | None = None,
    config: str | os.PathLike[str] | None = None,
) -> Routing:
    """Send ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` for these URL prefixes to dcp_volumes.

    Opt-in and reversible: see the module docstring for exactly which names of
    ``torch.distributed.checkpoint`` it replaces and how defaults are resolved.
    Calls for other ``checkpoint_id``\\ s, and calls that pass their own
    ``storage_writer`` / ``storage_reader``, go to stock DCP unchanged.

    Args:
        prefixes: URL or path prefixes (``"s3://bucket/"``, ``["s3://", "az://"]``),
            or a mapping of prefix -> that prefix's ``storage_options``. ``None``:
            the config file's prefixes, else ``DCP_VOLUMES_ROUTE``.
        storage_options: for every prefix of this call (a mapping in ``prefixes``
            wins for its prefix); default: the config file, else
            ``DCP_VOLUMES_STORAGE_OPTIONS``.
        staging_dir: the writers' staging directory.
        upload_concurrency: the writers' ``upload_concurrency``.
        read_concurrency: the readers' ``read_concurrency``.
        overwrite: let a save replace a committed checkpoint at its id (default
            ``True``, as stock DCP's writers).
        writer_options: further ``VolumeWriter`` keyword arguments (``part_size``...).
        reader_options: further ``VolumeReader`` keyword arguments (``verify``...).
        config: a TOML (or ``.json``) file of defaults and per-prefix options;
            default: ``DCP_VOLUMES_ROUTE_CONFIG``.

    Returns:
        A ``Routing`` handle: a context manager, or call ``remove()``.

    Raises:
        ConfigurationError: no prefix given or configured, or a bad option.
    """
    config_path = config if config is not None else _env.route_config()
    doc = _read_config(config_path) if config_path is not None else {}
    per_prefix = _chosen_prefixes(prefixes, doc)
    call: dict[str, Any] = {
        "storage_options": storage_options,
        "staging_dir": os.fspath(staging_dir) if staging_dir is not None else None,
        "upload_concurrency": upload_concurrency,
        "read_concurrency": read_concurrency,
        "overwrite": overwrite,
        "writer_options": writer_options,
        "reader_options": reader_options,
    }
    routes = [
        Route(prefix=prefix, **_layered_options(prefix, own_options, doc, call))
        for prefix, own_options in per_prefix.items()
    ]
    _TABLE.add(routes)
    return Routing(routes)


def _chosen_prefixes(
    prefixes: str | Sequence[str] | Mapping[str, Mapping[str, Any]] | None,
    doc: Mapping[str, Any],
) -> dict[str, Mapping[str, Any] | None]:
    """The prefixes to route, each with its own ``storage_options`` where ``prefixes`` maps
    one: ``route()``'s argument, else the config file's, else ``DCP_VOLUMES_ROUTE``."""
    per_prefix: dict[str, Mapping[str, Any] | None]
    if prefixes is None:
        listed = list(doc.get("prefixes", []))
        names = listed + [p for p in doc.get("routes", {}) if p not in listed]
        if not names:
            names = _env.route_prefixes()
        if not names:
            raise ConfigurationError(
                "route() has no URL prefix to route: pass prefixes (e.g. route(['s3://bucket/'])), "
                f"list them in a config file ({_env.ROUTE_CONFIG}), or set {_env.ROUTE}, e.g. "
                f"{_env.ROUTE}=s3://,az://."
            )
        per_prefix = dict.fromkeys(names)
    elif isinstance(prefixes, str):
        per_prefix = {prefixes: None}
    elif isinstance(prefixes, Mapping):
        per_prefix = dict(prefixes.items())
    else:
        per_prefix = dict.fromkeys(prefixes)
    if not per_prefix:
        raise ConfigurationError("route() got an empty list of prefixes: name at least one.")
    return per_prefix


def _layered_options(
    prefix: str,
    own_options: Mapping[str, Any] | None,
    doc: Mapping[str, Any],
    call: Mapping[str, Any],
) -> dict[str, Any]:
    """One route's options, later layers winning: the environment's storage options, the
    config file's top level, its ``[routes."<prefix>"]`` table, ``route()``'s arguments
    (``call``; ``None``: not given), and the prefix's own ``storage_options``."""
    options: dict[str, Any] = {"storage_options": _env.storage_options()}
    options.update({k: v for k, v in doc.items() if k in _OPTION_KEYS})
    options.update(doc.get("routes", {}).get(prefix, {}))
    options.update({k: v for k, v in call.items() if v is not None})
    if own_options is not None:
        options["storage_options"] = own_options
    return options


def unroute() -> None:
    """Remove every route and restore ``torch.distributed.checkpoint``'s functions."""
    _TABLE.remove(None)
    logger.info("dcp_volumes routing off")


def active_routes() -> tuple[Route, ...]:
    """The routes in effect now (empty when routing is off)."""
    return _TABLE.routes

