"""The package's version, for `moelora --version` and the server's /version."""
from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed distribution's version; "unknown" when the package runs from a source tree that was never
    installed (PYTHONPATH), which has no distribution metadata."""
    try:
        return version("moelora")
    except PackageNotFoundError:
        return "unknown"
