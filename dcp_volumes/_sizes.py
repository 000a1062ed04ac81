"""Byte sizes: parsing what users write (``"100GB"``) and formatting for people (``1.5 MiB``)."""

from __future__ import annotations

from dcp_volumes._exceptions import ConfigurationError

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(value: int | str | None, *, what: str = "size") -> int | None:
    """Bytes from an int or a string like ``"100GB"``, ``"512MiB"``, ``"1.5g"``.

    ``None`` stays ``None`` (no limit). Binary units: ``GB`` and ``GiB`` both
    mean 2**30, as disk tools on Linux report them.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigurationError(f"{what}={value!r} is not a size; use bytes or e.g. '100GB'.")
    if isinstance(value, int):
        if value < 0:
            raise ConfigurationError(f"{what}={value} must be >= 0 bytes.")
        return value
    text = str(value).strip().lower().replace(" ", "")
    for suffix in ("ib", "b"):
        if text.endswith(suffix) and text[: -len(suffix)][-1:].isalpha():
            text = text[: -len(suffix)]
            break
    unit = text[-1:] if text[-1:].isalpha() else ""
    number = text[:-1] if unit else text
    if unit == "b":
        unit = ""
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or amount < 0:
        raise ConfigurationError(
            f"{what}={value!r} is not a size. Use a byte count or a string such as "
            "'512MB', '100GB' or '1.5TB'."
        )
    return int(amount * _UNITS[unit])


def format_size(nbytes: float | None) -> str:
    """``1536`` -> ``1.5 KiB`` (``None``: ``-``), for messages, logs and the CLI."""
    if nbytes is None:
        return "-"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
