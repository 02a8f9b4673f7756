"""Reading the settings' sources with pydantic-settings: flags > ``MQDS_<NAME>`` environment > TOML file > defaults.

``SettingsReader`` builds a pydantic-settings model from the fields of
``NodeConfig`` (each value read by its parser in ``units``) and returns the
merged values; a bad value becomes a ConfigError that says where it came from,
which setting it is and what that setting accepts.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationError, create_model
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from mqds.server.config.units import PARSERS, describe, kind_of

ENV_PREFIX = "MQDS_"


class ConfigError(ValueError):
    """The settings are wrong; the message says which and why."""


# The environment and the TOML file of the read in progress (load_config takes them as arguments).
_SOURCES: ContextVar[tuple[Mapping[str, str], str | None]] = ContextVar("mqds_config_sources")


@contextmanager
def _sources(environ: Mapping[str, str], toml_file: str | None) -> Iterator[None]:
    token = _SOURCES.set((environ, toml_file))
    try:
        yield
    finally:
        _SOURCES.reset(token)


class _Environment(EnvSettingsSource):
    """``MQDS_<NAME>`` variables of the given mapping (``os.environ`` unless a test passes its own)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {key.lower(): value for key, value in self._environ.items()}


class _SettingsBase(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, case_sensitive=False, extra="forbid", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (the init arguments) beat the environment, which beats the TOML file; defaults come last."""
        environ, toml_file = _SOURCES.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, _Environment(settings_cls, environ)]
        if toml_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


class SettingsReader:
    """Reads the settings named by a dataclass's fields (their defaults, types and names)."""

    def __init__(self, fields: Iterable[dataclasses.Field[Any]]) -> None:
        self.defaults = {f.name: f.default for f in fields}
        self.model = create_model(
            "NodeSettings",
            __base__=_SettingsBase,
            **{name: self._field(name, default) for name, default in self.defaults.items()},
        )

    @staticmethod
    def _field(name: str, default: Any) -> Any:
        parser = PARSERS[kind_of(name, default)]
        return (Annotated[type(default), BeforeValidator(parser)], default)

    def read(self, flags: Mapping[str, Any], environ: Mapping[str, str], toml_file: str | None) -> dict[str, Any]:
        """Every setting's value: from ``flags`` (by name), else ``environ``, else ``toml_file``, else default."""
        if toml_file:
            try:
                with open(toml_file, "rb"):
                    pass
            except OSError as err:
                raise ConfigError(f"cannot read config file {toml_file}: {err.strerror}") from None
        try:
            with _sources(environ, toml_file):
                return self.model(**flags).model_dump()
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {toml_file} is not valid TOML: {err}") from None
        except ValidationError as err:
            raise ConfigError(self._explain(err, flags, environ, toml_file)) from None

    def _explain(
        self, err: ValidationError, flags: Mapping[str, Any], environ: Mapping[str, str], toml_file: str | None
    ) -> str:
        """The first problem as an operator reads it: where the value came from, the setting, what it accepts."""
        first = err.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "?"
        if first["type"] == "extra_forbidden" or name not in self.defaults:
            return f"config file {toml_file}: unknown setting {name!r} (known: {', '.join(sorted(self.defaults))})"
        env_keys = [key for key in environ if key.lower() == (ENV_PREFIX + name).lower()]
        if name in flags:
            source = "flag --" + name.replace("_", "-")
        elif env_keys:
            source = f"environment variable {env_keys[0]}"
        else:
            source = f"config file {toml_file}"
        kind = kind_of(name, self.defaults[name])
        return f"{source}: {name} must be {describe(kind)}, got {first['input']!r}"
