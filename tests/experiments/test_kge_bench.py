"""The PyKEEN benchmark skips cleanly without its peers."""

import json

from experiments.bench import kge_vs_pykeen


def test_skips_with_a_clear_message_without_peers(monkeypatch, capsys):
    monkeypatch.setattr(
        kge_vs_pykeen.importlib.util, "find_spec", lambda name: None if name == "pykeen" else 1
    )
    out = kge_vs_pykeen.main(["--quick"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "skipped" in lines[0] and "pykeen" in lines[0] and "peers" in lines[0]
    assert json.loads(lines[-1]) == out and "skipped" in out
