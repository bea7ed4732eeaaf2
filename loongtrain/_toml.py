"""``tomllib`` on Python >= 3.11, the ``tomli`` backport (a dependency there) on 3.10."""

try:
    import tomllib  # novermin
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["tomllib"]
