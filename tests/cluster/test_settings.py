"""VELOX_REDIS_URL: accepted forms, clear errors naming the variable, the password never shown."""

from __future__ import annotations

import pytest

from velox.config import settings as config


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://cache.internal:6380",
                                 "redis://user:secret@10.0.0.5/3", "redis://localhost"])
def test_accepted(url: str) -> None:
    assert config.load({"VELOX_REDIS_URL": url}, dotenv=None).redis_url == url


def test_unset_means_one_host() -> None:
    assert config.load({}, dotenv=None).redis_url == ""


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://", "redis://h:99999",
                                 "redis://h/notanumber", "127.0.0.1:6379"])
def test_refused_with_the_variable_named(url: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({"VELOX_REDIS_URL": url}, dotenv=None)
    assert str(err.value).startswith("VELOX_REDIS_URL=")
    assert "redis://[user:password@]host[:port][/db] or rediss://" in str(err.value)


def test_the_password_is_never_shown() -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({"VELOX_REDIS_URL": "redis://u:hunter2@h/x"}, dotenv=None)
    assert "hunter2" not in str(err.value) and "u:***@h" in str(err.value)
    settings = config.load({"VELOX_REDIS_URL": "redis://u:hunter2@h:1/0"}, dotenv=None)
    assert settings.redacted()["VELOX_REDIS_URL"] == "redis://u:***@h:1/0"
    assert "hunter2" not in repr(settings)


def test_a_restart_is_needed_to_change_it() -> None:
    from velox.supervisor import _FIXED_AT_START

    assert "redis_url" in _FIXED_AT_START
