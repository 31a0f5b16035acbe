"""Bad point and study files the issue reported and their neighbours, each pinned with the one line it must give
(tests/test_bad_input.py mutates files at random; these are the cases a person wrote down)."""

import pytest
from conftest import ROOT
from helpers import run_cli

from dse.point.points import load_point

# ---- the cases the issue reported, each pinned ----------------------------------------------------------------

POINT = """\
model: tiny-llama
workload: {seq_len: 256, global_batch: 16}
parallel: {dp: 8}
system: tiny-ring
"""


def bad_point(old: str, new: str) -> str:
    assert old in POINT
    return POINT.replace(old, new)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (bad_point("tiny-llama", "{base: llama3-8b, layers: 1000000000000}"), ["field 'model.layers'", "at most 1024"]),
        (bad_point("seq_len: 256", "seq_len: 1e9"), ["field 'workload.seq_len'", "at most 16777216", "1000000000"]),
        (bad_point("tiny-llama", "{base: tiny-llama, hidden: 1e9}"), ["field 'model.hidden'", "at most 1048576"]),
        (bad_point("dp: 8", "dp: 8, tp: true"), ["field 'parallel.tp'", "not a boolean"]),
        (bad_point("dp: 8", "dp: 8, zero: true"), ["field 'parallel.zero'", "not a boolean"]),
        (bad_point("dp: 8", "dp: 8, zero: 1, fsdp: fsdp1"), ["field 'parallel.fsdp'", "parallel.zero: 3"]),
        (bad_point("dp: 8", "dp: 8, cp_algorithm: ring"), ["field 'parallel.cp_algorithm'", "parallel.cp above 1"]),
        (bad_point("dp: 8", "dp: 8, recompute_every: 2"), ["field 'parallel.recompute_every'", "none"]),
        (
            bad_point("tiny-ring", "{base: tiny-ring, network: {0: {bandwidth_GBps: 1e-300}}}"),
            ["field 'system.network.0.bandwidth_GBps'", "at least 0.001"],
        ),
        (
            bad_point("tiny-ring", "{base: tiny-ring, network: {0: {latency_ns: .inf}}}"),
            ["field 'system.network.0.latency_ns'", "finite"],
        ),
        (
            bad_point("tiny-ring", "{base: tiny-ring, accelerator: {kernel_launch_us: .nan}}"),
            ["field 'system.accelerator.kernel_launch_us'", "finite"],
        ),
        (
            bad_point("tiny-ring", "{base: tiny-ring, accelerator: {hbm_GiB: .inf}}"),
            ["field 'system.accelerator.hbm_GiB'", "finite"],
        ),
        (POINT + "model: tiny-gpt\n", ["line 5", "key 'model' is given twice (first at line 1)"]),
        (bad_point("dp: 8", "dp: 4"), ["parallel.dp*tp*pp*cp = 4*1*1*1 = 4", "8 NPUs"]),
        (
            bad_point("tiny-llama", "{base: tiny-llama, dtype: fp8}").replace("tiny-ring", "{base: dgx-a100}"),
            ["model.dtype=fp8", "no peak_tflops.fp8"],
        ),
        (
            bad_point("dp: 8", "dp: 4, cp: 2, cp_algorithm: ring, recompute: full"),
            ["parallel.cp_algorithm=ring with parallel.recompute=full is not supported yet", "allgather"],
        ),
        (
            bad_point("seq_len: 256", "mode: prefill, seq_len: 256").replace(
                "dp: 8", "dp: 4, tp: 2, pp_schedule: interleaved, virtual_stages: 2"
            ),
            ["virtual_stages=2 is a training schedule", "use pp_schedule 1f1b or gpipe with workload.mode=prefill"],
        ),
        (
            bad_point("global_batch: 16", "global_batch: 16000000").replace("dp: 8", "dp: 2, pp: 4"),
            ["x model.layers=4 = 32,000,000 layer passes is over the limit of 262,144", "workload.micro_batch"],
        ),
    ],
    ids=[
        "layers-1e12",
        "seq-len-1e9",
        "hidden-1e9",
        "tp-true",
        "zero-true",
        "fsdp-without-zero-3",
        "cp-algorithm-without-cp",
        "recompute-every-without-recompute",
        "bandwidth-1e-300",
        "latency-inf",
        "launch-nan",
        "hbm-inf",
        "duplicate-key",
        "infeasible-names-file",
        "dtype-the-accelerator-lacks",
        "ring-cp-with-full-recompute",
        "interleaved-inference",
        "pipeline-passes-limit",
    ],
)
def test_bad_point_file_gives_one_line_naming_file_and_field(tmp_path, text, fragments):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    code, out, err = run_cli("evaluate", str(path), "--json")
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    for fragment in fragments:
        assert fragment in err


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            bad_point("dp: 8", "dp: 8, recompute: full, recompute_every: 5"),
            ["field 'parallel.recompute_every': 5 is beyond model.layers=4", "set it to at most model.layers"],
        ),
        (
            bad_point("dp: 8", "dp: 8, layer_strategies: [dp]"),
            ["field 'parallel.layer_strategies'", "parallel.tp above 1, and parallel.tp is 1"],
        ),
        (
            bad_point("tiny-llama", "tiny-mamba").replace(
                "global_batch: 16", "global_batch: 16, attention_kernel: fa2"
            ),
            ["field 'workload.attention_kernel'", "a model.family with attention layers (not mamba)"],
        ),
        (bad_point("dp: 8", "dp: 8, sp: true"), ["field 'parallel.sp'", "parallel.tp above 1"]),
        (
            bad_point("global_batch: 16", "global_batch: 16, mode: prefill").replace("dp: 8", "dp: 8, recompute: full"),
            ["field 'parallel.recompute'", "workload.mode: train"],
        ),
        (
            bad_point("tiny-llama", "{base: tiny-llama, dropout: true}").replace("seq_len", "mode: decode, seq_len"),
            ["field 'model.dropout'", "workload.mode: train"],
        ),
        (
            bad_point("tiny-llama", "{base: tiny-llama, rope_impl: real}"),
            ["field 'model.rope_impl'", "workload.kernels: eager"],
        ),
        (
            bad_point("tiny-llama", "{base: tiny-mamba, heads: 16}"),
            ["field 'model.heads'", "model.family is 'mamba'", "use family hybrid"],
        ),
        (
            bad_point("tiny-llama", "{base: tiny-deepseek, kv_heads: 2}"),
            ["field 'model.kv_heads'", "model.mla is set; remove model.kv_heads or remove model.mla"],
        ),
        (
            bad_point("tiny-llama", "{base: tiny-llama, max_seq: 4096}"),
            ["field 'model.max_seq'", "only takes effect with model.position: learned"],
        ),
        (
            bad_point("tiny-ring", "{base: tiny-ring, accelerator: {sm_count: null, gemm_tile: [128, 64]}}"),
            ["field 'system.accelerator'", "gemm_tile would be ignored", "set sm_count"],
        ),
        (
            bad_point(
                "tiny-ring",
                "{base: tiny-ring, accelerator: {attention_kernels: {fa2: {causal: {fwd: {0: [64, 512, 18000]}}}}}}",
            ),
            ["attention_kernels.fa2.causal.fwd: row [64, 512, 18000.0]", "measured_peak_tflops) of 989.4"],
        ),
    ],
    ids=[
        "recompute-every-beyond-the-layers",
        "dp-layers-without-tp",
        "attention-kernel-on-mamba",
        "sp-without-tp",
        "recompute-in-prefill",
        "dropout-in-decode",
        "rope-impl-under-fused-kernels",
        "heads-on-mamba",
        "kv-heads-with-latent-attention",
        "max-seq-with-rope",
        "gemm-tile-without-sm-count",
        "attention-table-above-peak",
    ],
)
def test_a_setting_that_would_be_ignored_is_refused(tmp_path, text, fragments):
    """Settings that change nothing (issue 30; tests/test_ignored_settings.py walks every field)."""
    test_bad_point_file_gives_one_line_naming_file_and_field(tmp_path, text, fragments)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (POINT.replace("tiny-llama", "tiny-llama # café").encode("latin-1"), "byte 0xe9 at line 1, column 24"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "byte 0x89 at line 1, column 1 is not UTF-8"),
        (POINT.encode().replace(b"parallel", b"paral\x00lel"), "character 0x0000 at line 3, column 6"),
        (b"", "got an empty file"),
        (b"a: [" * 40 + b"]" * 40, "nested more than 32 levels deep"),
    ],
    ids=["latin-1", "binary", "nul", "empty", "deep"],
)
def test_a_file_that_is_not_yaml_text_gives_one_line(tmp_path, data, fragment):
    path = tmp_path / "p.yaml"
    path.write_bytes(data)
    code, _, err = run_cli("evaluate", str(path))
    assert code == 2 and err.count("\n") == 1 and fragment in err and str(path) in err, err


def test_a_utf16_file_with_a_byte_order_mark_reads_as_its_utf8_twin(tmp_path):
    (tmp_path / "a.yaml").write_text(POINT)
    (tmp_path / "b.yaml").write_bytes(POINT.encode("utf-16"))
    assert load_point(tmp_path / "a.yaml") == load_point(tmp_path / "b.yaml")


def test_accelerator_overrides_merge_into_the_base_systems_accelerator(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(bad_point("tiny-ring", "{base: dgx-h100, accelerator: {hbm_GiB: 141}, network: {1: {npus: 1}}}"))
    accelerator = load_point(path).system.accelerator
    assert (accelerator.name, accelerator.hbm_GiB) == ("h100-sxm", 141)
    assert (
        accelerator.peak_tflops
        == load_point(ROOT / "studies/points/llama3-8b-fsdp.yaml").system.accelerator.peak_tflops
    )
    path.write_text(
        bad_point("tiny-ring", "{base: dgx-h100, accelerator: {base: h200, hbm_GiB: 100}, network: {1: {npus: 1}}}")
    )
    assert (load_point(path).system.accelerator.name, load_point(path).system.accelerator.hbm_GiB) == ("h200", 100)


def test_whole_floats_are_counts_and_yaml_1_2_numbers(tmp_path):
    """8192.0 and 8e3 are whole numbers (JSON writers and YAML exponents give floats); 017 is 17, not octal."""
    path = tmp_path / "p.yaml"
    path.write_text(bad_point("seq_len: 256, global_batch: 16", "seq_len: 2.56e2, global_batch: 016"))
    workload = load_point(path).workload
    assert (workload.seq_len, type(workload.seq_len), workload.global_batch) == (256, int, 16)


STUDY = (ROOT / "studies" / "small.yaml").read_text()


@pytest.mark.parametrize(
    ("old", "new", "fragments"),
    [
        (
            "parallel.pp: {choices: [1, 2, 4]}",
            "parallel.pp: {choices: [1, 2, 4]}\n  parallel.zero: {choices: [0, 7]}",
            ["field 'space.parallel.zero': choice 7", "0, 1, 2 or 3"],
        ),
        ("parallel.pp: {choices: [1, 2, 4]}", "parallel.pp: {choices: [1, 0]}", ["'space.parallel.pp': choice 0"]),
        ("parallel.pp: {choices: [1, 2, 4]}", "parallel.pp: {low: 1, high: 4.5}", ["whole low and high"]),
        ("parallel.pp: {choices: [1, 2, 4]}", "parallel.pp: {low: 1, high: 4, step: 0}", ["'space.parallel.pp.step'"]),
        (
            "parallel: {zero: 1}",
            "parallel: {zero: 1, fsdp: fsdp1}",
            ["field 'base.parallel.fsdp': 'fsdp1' only takes effect with parallel.zero: 3, which no point"],
        ),
        (
            "parallel: {zero: 1}",
            "parallel: {zero: 1, recompute: full, recompute_every: 1000}",
            ["field 'base.parallel.recompute_every': no point of the study gives 1000 effect", "model.layers"],
        ),
        ("world / (parallel.tp * parallel.pp)", "-" * 20000 + "1", ["'derived.parallel.dp'", "limit of 500"]),
        ("world / (parallel.tp * parallel.pp)", "-" * 40 + "1", ["'derived.parallel.dp'", "32 levels"]),
        ("world / (parallel.tp * parallel.pp)", "2 * 1e400", ["too large for a float"]),
        ("trials: 8", "trials: true", ["field 'trials'", "not a boolean"]),
        ("seed: 7", "seed: -1", ["field 'seed'", "at least 0"]),
        ("name: small", "name: small\nname: big", ["line 5", "key 'name' is given twice"]),
    ],
    ids=[
        "every-choice-checked",
        "degree-0",
        "float-range-for-int",
        "step-0",
        "fsdp-no-point-enables",
        "recompute-every-beyond-every-points-layers",
        "20000-minus-signs",
        "deep-expression",
        "huge-literal",
        "trials-true",
        "negative-seed",
        "duplicate-key",
    ],
)
def test_bad_study_file_gives_one_line_naming_file_and_field(tmp_path, old, new, fragments):
    assert old in STUDY
    path = tmp_path / "s.yaml"
    path.write_text(STUDY.replace(old, new))
    code, out, err = run_cli("check", str(path))
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    for fragment in fragments:
        assert fragment in err


def test_a_study_may_set_a_refinement_some_of_its_points_give_effect(tmp_path):
    path = tmp_path / "s.yaml"
    text = STUDY.replace("parallel: {zero: 1}", "parallel: {fsdp: fsdp1}").replace(
        "parallel.pp: {choices: [1, 2, 4]}", "parallel.pp: {choices: [1, 2, 4]}\n  parallel.zero: {choices: [1, 3]}"
    )
    path.write_text(text)
    code, out, err = run_cli("check", str(path))
    assert code == 0, err
    assert out.startswith(f"{path}: a valid study: small, 5 parameters, 96 points in the space, 8 evaluations (random)")
    assert "13 points varying one parameter at a time from the first: 13 can run, 0 cannot" in out


def test_check_reports_the_points_that_cannot_run(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(STUDY.replace("workload.micro_batch: {choices: [1, 2]}", "workload.micro_batch: {choices: [1, 3]}"))
    code, out, err = run_cli("check", str(path))
    assert code == 0, err
    assert "11 points varying one parameter at a time from the first: 10 can run, 1 cannot" in out
    assert (
        "workload.micro_batch=3: workload.global_batch=16 is not a multiple of parallel.dp*workload.micro_batch" in out
    )


def test_check_a_point(tmp_path):
    code, out, err = run_cli("check", str(ROOT / "studies/points/llama3-70b-dgx-h100.yaml"))
    assert code == 0, err
    assert "a valid point: llama3-70b (7.06e+10 parameters) on 1024 NPUs of dgx-h100, key b841f8908b0d446b" in out
