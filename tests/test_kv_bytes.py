"""The KV cache bytes that `inspect` and the run statistics print, against config.json read here."""

import json
from pathlib import Path

import dflash2_numba as dn
from dflash2_numba.inspect_model import format_inspect, inspect_model

TARGET = Path(dn.__file__).parent / "assets" / "default" / "target"


def test_inspect_and_statistics_print_the_cache_bytes():
    c = json.loads((TARGET / "config.json").read_text())
    per = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4  # K and V, f32
    report = inspect_model(TARGET, hash_files=False)
    assert report["kv_cache"] == {"bytes_per_position": per, "max_positions": c["max_position_embeddings"],
                                  "bytes_at_max": per * c["max_position_embeddings"]}
    assert "kv cache:   4.0 KiB per position" in format_inspect(report)
    target = dn.load_target(TARGET)
    r = dn.generate(target, None, prompt_ids=list(range(1, 40)), max_new_tokens=5)
    assert r.stats.kv_cache_bytes == per * (39 + len(r.output_ids))
    assert f"kv cache {per * (39 + len(r.output_ids)) / 2**20:.1f} MiB at {39 + len(r.output_ids)} positions" \
        in r.stats.format()
