"""jupyter_shard._util.plugins: the entry points of a group, by name, kept until ``sys.path`` changes.

Distributions are made for real: a ``*.dist-info`` directory with an ``entry_points.txt`` in a
directory put on ``sys.path``, as ``pip install`` leaves them. Each test uses a group of its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jupyter_shard._util import plugins
from jupyter_shard._util.plugins import entry_point_map


def _install(site: Path, dist: str, group: str, **points: str) -> None:
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    stamp = os.stat(site).st_mtime_ns + 10**9  # a directory's time changes as an install changes it
    os.utime(site, ns=(stamp, stamp))


@pytest.fixture
def group(request: pytest.FixtureRequest) -> str:
    return f"jupyter_shard_test.{request.node.name}"


def test_names_map_to_their_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str) -> None:
    _install(tmp_path, "shard_plugin", group, slurmx="shard_plugin.launch:SlurmX", mine="shard_plugin:Mine")
    _install(tmp_path, "other_plugin", "some.other.group", elsewhere="other:X")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = entry_point_map(group)
    assert sorted(found) == ["mine", "slurmx"]
    assert found["slurmx"].value == "shard_plugin.launch:SlurmX" and found["slurmx"].group == group
    assert entry_point_map("jupyter_shard_test.no_such_group") == {}


def test_the_first_of_a_duplicated_name_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    _install(first, "plugin_a", group, same="a:Launcher")
    _install(second, "plugin_b", group, same="b:Launcher", only_b="b:Other")
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))  # earlier on sys.path
    found = entry_point_map(group)
    assert found["same"].value == "a:Launcher" and found["only_b"].value == "b:Other"


def test_the_scan_is_kept_while_sys_path_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    _install(tmp_path, "kept_plugin", group, one="k:One")
    monkeypatch.syspath_prepend(str(tmp_path))
    scans: list[str | None] = []
    real = plugins.entry_points

    def counting(**kwargs: str) -> object:
        scans.append(kwargs.get("group"))
        return real(**kwargs)

    monkeypatch.setattr(plugins, "entry_points", counting)
    first = entry_point_map(group)
    assert entry_point_map(group) is first
    assert scans == [group], "one scan of the installed distributions"


def test_a_plugin_installed_on_a_new_path_entry_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    assert entry_point_map(group) == {}
    _install(tmp_path, "late_plugin", group, late="late:Plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert list(entry_point_map(group)) == ["late"]


def test_a_plugin_installed_into_a_directory_already_on_the_path_is_found_after_the_recheck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "RECHECK", 3600.0)
    assert entry_point_map(group) == {}
    _install(site, "mid_session", group, new="mid:New")
    assert entry_point_map(group) == {}, "sys.path's directories are looked at most once per RECHECK"
    monkeypatch.setattr(plugins, "RECHECK", 0.0)
    assert list(entry_point_map(group)) == ["new"]


def test_a_missing_path_entry_does_not_stop_the_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    _install(tmp_path / "real", "real_plugin", group, here="r:Here")
    monkeypatch.syspath_prepend(str(tmp_path / "real"))
    monkeypatch.syspath_prepend(str(tmp_path / "gone"))
    assert list(entry_point_map(group)) == ["here"]
    assert str(tmp_path / "gone") in sys.path


def _registry(group: str) -> plugins.Registry[object]:
    return plugins.Registry(
        group,
        {"plain": object, "lazy": "collections:OrderedDict"},
        "no plugin {name!r}; available: {available}",
        error=KeyError,
    )


def test_a_registry_looks_in_this_process_then_built_ins_then_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str
) -> None:
    import collections

    (tmp_path / "ep_target.py").write_text("class Installed:\n    pass\n")
    _install(tmp_path, "ep_dist", group, installed="ep_target:Installed", plain="ep_target:Installed")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = _registry(group)
    assert registry.available() == ["installed", "lazy", "plain"]
    assert "ep_target" not in sys.modules, "listing imports nothing"
    assert registry.get("plain") is object, "a built-in wins over an entry point of the same name"
    assert registry.get("lazy") is collections.OrderedDict, "a 'module:attr' built-in is imported when asked"
    assert registry.get("installed").__name__ == "Installed"
    registry.register("plain", dict, size=3)
    assert registry.get("plain") is dict and registry.defaults("plain") == {"size": 3}
    assert registry.defaults("lazy") == {} and registry.registration("lazy") is None
    assert list(registry.loaded()) == ["plain", "lazy", "installed"]


def test_a_registry_names_what_is_available_for_an_unknown_name(group: str) -> None:
    registry = _registry(group)
    with pytest.raises(KeyError, match=r"no plugin 'nope'; available: lazy, plain"):
        registry.get("nope")
    own: dict[str, plugins.Registration[object]] = {"mine": (int, {})}
    shared = plugins.Registry(group, {}, "{name} not in {available}", registered=lambda: own)
    assert shared.available() == ["mine"] and shared.get("mine") is int
    own.pop("mine")  # the registered dict is read on every use
    assert shared.available() == []
