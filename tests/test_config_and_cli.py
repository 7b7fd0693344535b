"""Config reading (HF keys, presets, errors) and the command line."""

import json
import subprocess
import sys

import pytest

from megakernel.run import main
from model import PRESETS, ConfigError, ModelConfig, init_weights, preset, save_checkpoint
from model.stats import active_parameters, parameter_count, step_bytes


@pytest.mark.parametrize("name", PRESETS)
def test_presets_round_trip_through_config_json(name, tmp_path):
    cfg = preset(name)
    cfg.save(tmp_path)
    assert ModelConfig.from_dir(tmp_path) == cfg


def test_preset_sizes():
    lite = preset("dsv2-lite")
    assert abs(parameter_count(lite) / 1e9 - 15.7) < 0.05
    assert abs(active_parameters(lite) / 1e9 - 2.4) < 0.1
    llama = preset("llama-1b")
    assert abs(parameter_count(llama) / 1e9 - 1.24) < 0.01
    assert abs(step_bytes(llama, context=0).weight_bytes / 1e9 - 2.47) < 0.01
    v3 = preset("dsv3-slice")
    assert (v3.hidden_size, v3.q_lora_rank, v3.n_routed_experts, v3.num_experts_per_tok,
            v3.n_group) == (7168, 1536, 256, 8, 8)
    assert v3.num_hidden_layers == 4 and v3.num_nextn_predict_layers == 1 and v3.scoring_func == "sigmoid"


def test_rope_groups_share_tables():
    cfg = preset("tiny-dense").replace(num_hidden_layers=38,
                                       rope_theta_per_layer=tuple(1e4 * (1 + i % 8) for i in range(38)))
    assert len({cfg.rope_for_layer(i).key() for i in range(38)}) == 8


def _hf(**changes):
    d = preset("tiny-moe").to_hf_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,pattern", [
    (dict(architectures=["GPT2LMHeadModel"]), r"unknown architecture 'GPT2LMHeadModel'"),
    (dict(architectures=None, model_type="bert"), r"unknown model_type 'bert'"),
    (dict(hidden_size=None), r"missing key\(s\) 'hidden_size'"),
    (dict(kv_lora_rank=None, v_head_dim=None), r"missing key\(s\) 'kv_lora_rank', 'v_head_dim'"),
    (dict(num_experts_per_tok=None), r"missing key\(s\) 'num_experts_per_tok'"),
    (dict(hidden_size="big"), r"key 'hidden_size' has value 'big'"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 exceeds n_routed_experts=8"),
    (dict(n_group=3), r"not divisible by n_group=3"),
    (dict(scoring_func="relu"), r"scoring_func"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_scaling type 'dynamic'"),
    (dict(num_attention_heads=4, num_key_value_heads=3), r"not a multiple of num_key_value_heads=3"),
])
def test_config_errors_name_the_key(changes, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        ModelConfig.from_hf_dict(_hf(**changes))
    assert "\n" not in str(info.value)


def test_config_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


# ---- CLI --------------------------------------------------------------------------------------
def test_default_run_prints_what_it_did(capsys, tmp_path):
    assert main(["--json", str(tmp_path / "r.json"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tiny-moe" in out and "seeded random weights (seed 0)" in out and "tokens/s" in out
    assert "plan interpreter" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["model"] == "tiny-moe" and r["backend"] == "interpret" and len(r["tokens"][0]) == r["steps"] == 16
    assert set(r["plan"]) >= {"ops_before", "ops_after", "cse_merged", "tasks", "workers", "critical_path_ms_est"}


def test_interpreter_and_reference_backends_agree(capsys):
    runs = {}
    for backend in ("reference", "interpret"):
        assert main(["--device", "cpu", "--backend", backend, "--steps", "6", "--batch", "2",
                     "--json", "/dev/null"]) == 0
    out = capsys.readouterr().out.split("model tiny-moe")
    runs = [[line for line in o.splitlines() if line.strip().startswith("sequence")] for o in out[1:]]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "tiny-mhc"])
def test_check_passes_and_is_reported(name, tmp_path, capsys):
    assert main(["--model", name, "--backend", "interpret", "--check", "--steps", "5", "--batch", "2",
                 "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["check"]["ok"] and r["check"]["tokens_match"] and r["check"]["max_rel_err"] <= 1e-5
    assert "PASS" in capsys.readouterr().out


def test_norms_fold_by_default_and_no_fuse_norms_keeps_them(tmp_path, capsys):
    assert main(["--model", "tiny-dense", "--backend", "interpret", "--no-fuse-norms", "--check", "--steps", "4",
                 "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["check"]["ok"] and r["check"]["max_rel_err"] <= 1e-5
    capsys.readouterr()
    assert main(["--model", "tiny-dense", "--plan"]) == 0
    assert "norm_into_linear" in capsys.readouterr().out
    assert main(["--model", "tiny-dense", "--no-fuse-norms", "--plan"]) == 0
    assert "norm_into_linear" not in capsys.readouterr().out


def test_check_fails_on_a_mismatch(monkeypatch, capsys):
    import megakernel.ops as ops
    real = ops.REFERENCE["ATTN_COMBINE"]

    def broken(task, mem):
        real(task, mem)
        mem.mat(task, "out", 1, 4, row0=task["b"] * task["T"]).mul_(1.5)
    monkeypatch.setitem(ops.REFERENCE, "ATTN_COMBINE", broken)
    assert main(["--backend", "interpret", "--check", "--steps", "3"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_works_for_a_model_dir(tmp_path):
    cfg = preset("tiny-moe").replace(num_hidden_layers=2, q_lora_rank=None)
    save_checkpoint(cfg, init_weights(cfg, seed=5), tmp_path)
    assert main(["--model", str(tmp_path), "--backend", "interpret", "--check", "--steps", "3"]) == 0


def test_plan_flag_prints_the_plan(capsys, tmp_path):
    assert main(["--model", "dsv2-lite", "--plan", "--workers", "132", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "fusion" in out and "tasks:" in out and "critical path" in out
    assert json.loads((tmp_path / "p.json").read_text())["plan"]["tasks"] > 1000


def test_describe_dsv2_lite_allocates_nothing(capsys, monkeypatch):
    import model.weights
    monkeypatch.setattr(model.weights, "init_tensor", lambda *a, **k: pytest.fail("allocated a weight"))
    assert main(["--model", "dsv2-lite", "--describe"]) == 0
    out = capsys.readouterr().out
    assert "15.71B" in out and "2.45B" in out and "reads 5.030 GB" in out


def test_model_dir_with_and_without_weights(tmp_path, capsys):
    cfg = preset("tiny-dense")
    cfg.save(tmp_path)
    assert main(["--model", str(tmp_path), "--steps", "3", "--device", "cpu"]) == 0
    assert "seeded random weights" in capsys.readouterr().out
    save_checkpoint(cfg, init_weights(cfg, seed=3), tmp_path)
    assert main(["--model", str(tmp_path), "--steps", "3", "--device", "cpu"]) == 0
    assert f"checkpoint {tmp_path}" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["--model", "nope"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Foo"]}))
    assert main(["--model", str(tmp_path)]) == 2
    assert "unknown architecture 'Foo'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--prompt-len", "500", "--steps", "20"], "520 positions, more than tiny-moe's max_position_embeddings (512)"),
    (["--describe", "--ctx", "-5"], "--ctx must be >= 0"),
    (["--temperature", "0.7", "--backend", "reference"], "sampling (--temperature > 0) run on the interpret"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--temperature", "inf"], "--temperature must be >= 0 and finite"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "0.7", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-p", "0.9"], "--top-p 0.9 needs --temperature > 0"),
    (["--temperature", "0.7", "--check"], "--check runs with the plain greedy decoder"),
    (["--spec-k", "2", "--backend", "megakernel", "--profile", "p.json"],
     "--profile runs with the plain greedy decoder"),
    (["--helper", "cpu", "--helper-timeout", "0"], "--helper-timeout must be > 0 seconds"),
    # options the run would have ignored without a word, and inputs found only after the whole run
    (["--adaptive-k"], "--adaptive-k needs --spec-k K"),
    (["--temperature", "0.7", "--draft", "oracle"], "--draft needs --spec-k K"),
    (["--spec-k", "1", "--k-sweep", "s.json"], "--k-sweep needs --adaptive-k"),
    (["--spec-k", "1", "--adaptive-k", "--k-sweep", "/nonexistent/s.json"], "step-time sweep /nonexistent/s.json"),
    (["--profile", "p.json", "--backend", "interpret"], "--profile stamps the megakernel's tasks"),
    (["--migrate", "on"], "--migrate on needs --helper"),
    (["--json", "/nonexistent/dir/r.json"], "its folder /nonexistent/dir does not exist"),
    (["--device", "gpu"], "--device gpu: not a device torch knows"),
    (["--device", "cuda:64"], "CUDA device(s) torch can use"),
])
def test_cli_refuses_out_of_range_options_by_name(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--temperature", "0.5"], ["--spec-k", "0"]])
def test_cli_speculative_runs_of_two_tokens(argv):
    """A short speculative run still has the cache its longest step (the prompt's first chunk) needs."""
    assert main([*argv, "--steps", "2"]) == 0


def test_cli_samples_when_given_a_temperature(tmp_path):
    """--temperature > 0 without --spec-k samples (on the speculative decoder with no drafts), not greedily."""
    runs = []
    for extra in ([], ["--temperature", "1.5", "--seed", "4"], ["--temperature", "1.5", "--seed", "4"]):
        assert main(["--steps", "12", "--json", str(tmp_path / "r.json"), *extra]) == 0
        r = json.loads((tmp_path / "r.json").read_text())
        runs.append(r["tokens"])
    greedy, sampled, again = runs
    assert sampled == again and sampled != greedy  # seeded, and not the greedy continuation
    assert r["spec_k"] == 0 and r["temperature"] == 1.5


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "megakernel.run", "--help"], capture_output=True, text=True, check=True)
    assert "--describe" in out.stdout and "--model" in out.stdout


def test_speculative_cli_reports_acceptance(tmp_path, capsys):
    assert main(["--spec-k", "2", "--draft", "oracle", "--steps", "6", "--json", str(tmp_path / "s.json")]) == 0
    r = json.loads((tmp_path / "s.json").read_text())
    assert r["tokens_per_step"] == r["acceptance_length"] == 3 and r["per_position_acceptance"] == [1.0, 1.0]
    assert r["tokens_per_s"] > 0
    assert main(["--steps", "6", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["tokens"] == r["tokens"]
    assert main(["--spec-k", "9"]) == 2 and "within 0..7" in capsys.readouterr().err
