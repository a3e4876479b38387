"""``cachestore push|pull|inspect|prune`` with a remote URL (credentials from the environment)."""

from __future__ import annotations

import json

from cachestore import open_store
from cachestore.cli import main

from .conftest import SECRET, make_store, same


def test_push_pull_inspect_prune(tmp_path, s3_env, remote_url, capsys):
    local = make_store(tmp_path / "a", n=12)
    assert main(["push", str(tmp_path / "a"), remote_url, "--json"]) == 0
    pushed = json.loads(capsys.readouterr().out)
    assert pushed["generation"] == 0 and pushed["num_samples"] == 12
    with local.writer(1, 12) as w:
        for i in range(12):
            w.put(i, {"x": i})
    assert main(["push", str(tmp_path / "a"), remote_url]) == 0
    capsys.readouterr()
    assert main(["pull", remote_url, str(tmp_path / "b"), "--generation", "0"]) == 0
    capsys.readouterr()
    b = open_store(tmp_path / "b", readonly=True)
    assert all(same(b.reader(0)[i], local.reader(0)[i]) for i in range(12))
    assert main(["inspect", remote_url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (store,) = doc["stores"]
    assert [g["id"] for g in store["generations"]] == [0, 1]
    assert main(["inspect", remote_url]) == 0
    assert "generation 1: complete" in capsys.readouterr().out
    assert main(["prune", remote_url, "--keep", "1", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert [r["generation"] for r in dry["removed"]] == [0]
    assert main(["inspect", remote_url, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["stores"][0]["generations"]) == 2
    assert main(["prune", remote_url, "--keep", "1"]) == 0
    capsys.readouterr()
    assert main(["inspect", remote_url, "--json"]) == 0
    assert [g["id"] for g in json.loads(capsys.readouterr().out)["stores"][0]["generations"]] == [1]


def test_errors_name_no_credential(tmp_path, s3_env, remote_url, capsys, monkeypatch):
    make_store(tmp_path / "a", n=3)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET + "-bad")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody-" + SECRET[-6:])
    assert main(["push", str(tmp_path / "a"), remote_url]) == 1
    err = capsys.readouterr().err
    assert "error" in err and SECRET not in err and SECRET[-6:] not in err
