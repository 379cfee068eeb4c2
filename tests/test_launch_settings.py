"""``DISTCOMPAT_WATCHDOG``, ``DISTCOMPAT_MISMATCH_CHECK`` and the choices made from them.

Environments are dicts here, read by no process (unit tests of the parsing).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from distcompat import LaunchEnvError
from distcompat.cli._doctor import collect_report
from distcompat.launch._settings import DEFAULT_WATCHDOG_S, choose_mismatch_check, choose_watchdog

TEN_MIN = timedelta(minutes=10)


def test_default_is_report_only_after_120s() -> None:
    choice = choose_watchdog(None, group_timeout=TEN_MIN, environ={})
    assert (choice.seconds, choice.action) == (DEFAULT_WATCHDOG_S, "report")
    assert choice.headline == "report-only after 120s"
    assert "distcompat's default" in choice.reason
    assert "DISTCOMPAT_WATCHDOG=<seconds>|off" in choice.reason


def test_default_stays_under_a_short_group_timeout() -> None:
    choice = choose_watchdog(None, group_timeout=timedelta(seconds=60), environ={})
    assert choice.seconds == 30.0
    assert "half the 0:01:00 group timeout" in choice.reason


@pytest.mark.parametrize(("text", "seconds"), [("3", 3.0), ("90.5", 90.5), (" 7 ", 7.0)])
def test_the_variable_sets_seconds(text: str, seconds: float) -> None:
    choice = choose_watchdog(None, group_timeout=TEN_MIN, environ={"DISTCOMPAT_WATCHDOG": text})
    assert (choice.seconds, choice.action) == (seconds, "report")
    assert choice.reason.endswith(f"DISTCOMPAT_WATCHDOG={text}")


@pytest.mark.parametrize("text", ["off", "OFF", "0", "false", "none"])
def test_the_variable_turns_it_off(text: str) -> None:
    choice = choose_watchdog(None, group_timeout=TEN_MIN, environ={"DISTCOMPAT_WATCHDOG": text})
    assert choice.seconds is None
    assert choice.headline == "off"


@pytest.mark.parametrize("text", ["abc", "-3", "inf", "nan", ""])
def test_a_bad_value_names_variable_value_and_rule(text: str) -> None:
    with pytest.raises(LaunchEnvError) as caught:
        choose_watchdog(None, group_timeout=TEN_MIN, environ={"DISTCOMPAT_WATCHDOG": text})
    assert caught.value.variable == "DISTCOMPAT_WATCHDOG"
    assert f"DISTCOMPAT_WATCHDOG={text!r}" in str(caught.value)
    assert "positive number of seconds nor 'off'" in str(caught.value)


def test_an_explicit_argument_wins_and_raises() -> None:
    env = {"DISTCOMPAT_WATCHDOG": "off"}
    choice = choose_watchdog(30, group_timeout=TEN_MIN, environ=env)
    assert (choice.seconds, choice.action) == (30.0, "raise")
    assert choice.reason == "raises HangError after 30s: watchdog=30 requested"
    off = choose_watchdog(False, group_timeout=TEN_MIN, environ={"DISTCOMPAT_WATCHDOG": "5"})
    assert off.seconds is None
    assert off.reason == "off: watchdog=False"


@pytest.mark.parametrize("bad", [0, -1.0, True])
def test_a_bad_argument_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="positive number of seconds or False"):
        choose_watchdog(bad, group_timeout=TEN_MIN, environ={})


def test_doctor_says_which_watchdog_and_refuses_a_bad_variable() -> None:
    torchrun = {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "abc",
    }  # fmt: skip
    report = collect_report(device="cpu", environ=torchrun)
    assert report.watchdog_reason.startswith("report-only after 120s: distcompat's default")
    assert "[rank 0] watchdog: report-only after 120s" in report.to_text()
    assert '"watchdog_reason": "report-only after 120s' in report.to_json()
    single = collect_report(device="cpu", environ={})
    assert single.watchdog_reason == (
        "none needed: single process (report-only after 120s if it were launched)"
    )
    bad = collect_report(device="cpu", environ=torchrun | {"DISTCOMPAT_WATCHDOG": "soon"})
    assert not bad.ok
    assert "DISTCOMPAT_WATCHDOG='soon'" in bad.problems[0]
    assert report.mismatch_reason.startswith("on: distcompat's default")
    assert "[rank 0] mismatch check: on: distcompat's default" in report.to_text()
    assert single.mismatch_reason == "none needed: single process (on if it were launched)"
    off = collect_report(device="cpu", environ=torchrun | {"DISTCOMPAT_MISMATCH_CHECK": "off"})
    assert off.mismatch_reason == "off: DISTCOMPAT_MISMATCH_CHECK=off"
    worse = collect_report(device="cpu", environ=torchrun | {"DISTCOMPAT_MISMATCH_CHECK": "x"})
    assert not worse.ok
    assert "DISTCOMPAT_MISMATCH_CHECK='x'" in worse.problems[0]


@pytest.mark.parametrize(
    ("text", "on"),
    [(None, True), ("", True), ("on", True), ("1", True), ("off", False), (" OFF ", False)],
)
def test_mismatch_check_is_on_unless_turned_off(text: str | None, on: bool) -> None:
    environ = {} if text is None else {"DISTCOMPAT_MISMATCH_CHECK": text}
    choice = choose_mismatch_check(environ=environ)
    assert choice.on is on
    assert choice.reason.startswith("on: " if on else "off: ")
    if not text or not text.strip():
        assert "distcompat's default" in choice.reason


def test_mismatch_check_refuses_other_values() -> None:
    with pytest.raises(LaunchEnvError, match="DISTCOMPAT_MISMATCH_CHECK='maybe'"):
        choose_mismatch_check(environ={"DISTCOMPAT_MISMATCH_CHECK": "maybe"})


def test_peer_links_listen_everywhere_unless_told_an_address_an_interface_or_off() -> None:
    from distcompat.launch._settings import PEER_LINKS_VARIABLE, choose_peer_links

    assert choose_peer_links(environ={}).bind == "0.0.0.0"
    assert choose_peer_links(environ={PEER_LINKS_VARIABLE: "on"}).on
    assert not choose_peer_links(environ={PEER_LINKS_VARIABLE: "off"}).on
    assert choose_peer_links(environ={PEER_LINKS_VARIABLE: " 10.0.0.3 "}).bind == "10.0.0.3"
    chosen = choose_peer_links(environ={PEER_LINKS_VARIABLE: "eth0"})
    assert (chosen.bind, chosen.reason) == ("eth0", "interface eth0: DISTCOMPAT_PEER_LINKS=eth0")
    for bad in ("10.0.0", "a very long interface name", "eth0;rm"):
        with pytest.raises(LaunchEnvError, match=f"DISTCOMPAT_PEER_LINKS='{bad}': expected on"):
            choose_peer_links(environ={PEER_LINKS_VARIABLE: bad})
