"""ServerArgs / make_parser: the flags the operator renders parse, bad values name the flag."""

import subprocess
import sys

import pytest

from shardline_runtime.server_args import ServerArgs, ServerArgsError, make_parser


def test_operator_style_arguments_parse():
    argv = [
        "--model-path", "/var/lib/shardline/models/tiny-llama/rev-a", "--served-model-name", "tiny",
        "--revision", "rev-a", "--host", "127.0.0.7", "--port", "8000", "--tp-size", "4",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "d-g0-0.d-g0-ranks.ns.svc:29500",
        "--dtype", "auto", "--mem-fraction-static", "0.85", "--cuda-graph-max-bs", "160",
        "--disable-cuda-graph",
    ]
    args = ServerArgs.from_cli(argv)
    assert args.host == "127.0.0.7" and args.node_rank == 1 and args.tp_size_per_node == 2
    assert args.disable_cuda_graph and args.model_name == "tiny"
    assert make_parser().parse_args(argv).dist_init_addr.endswith(":29500")


def test_overlap_schedule_is_on_by_default_and_the_flag_turns_it_off():
    assert ServerArgs.from_cli(["--model-path", "/m"]).disable_overlap_schedule is False
    assert ServerArgs.from_cli(["--model-path", "/m", "--disable-overlap-schedule"]).disable_overlap_schedule is True


@pytest.mark.parametrize(
    "flag,value,fragment",
    [
        ("--port", "0", "--port: must be in [1, 65535], got 0"),
        ("--tp-size", "0", "--tp-size: must be in [1, inf]"),
        ("--dtype", "int8", "--dtype: invalid choice"),
        ("--mem-fraction-static", "1.5", "--mem-fraction-static: must be in (0.0, 1.0]"),
        ("--dist-init-addr", "nohostport", "--dist-init-addr: must be HOST:PORT"),
        ("--node-rank", "x", "--node-rank: must be an integer"),
        ("--pp-size", "0", "--pp-size: must be in [1, inf], got 0"),
        # no abbreviations: spec.runtime.args ["--pp-s", "1"] would override the operator's --pp-size
        ("--pp-s", "1", "unrecognized arguments: --pp-s 1"),
        ("--tp", "2", "unrecognized arguments: --tp 2"),
    ],
)
def test_bad_flag_values_name_the_flag(flag, value, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        ServerArgs.from_cli(["--model-path", "/m", flag, value])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "divisible by --nnodes"),
        (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "h:1"], "--node-rank must be in [0, 1]"),
        (["--nnodes", "2", "--tp-size", "2"], "--dist-init-addr HOST:PORT is required"),
    ],
)
def test_cross_field_rules(argv, fragment):
    with pytest.raises(ServerArgsError, match=None) as exc:
        ServerArgs.from_cli(["--model-path", "/m", *argv])
    assert fragment in str(exc.value)


def test_frozen():
    args = ServerArgs(model_path="/m")
    with pytest.raises(Exception):
        args.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("argv, fragment", [
    (["--nnodes", "2", "--tp-size", "2"], "--dist-init-addr"),
    # an argparse error: its message (naming the flag), not only "see the container log"
    (["--pp-size", "0"], "invalid arguments: shardline-runtime serve: error: argument --pp-size: must be in [1, inf], got 0"),
])
def test_cli_writes_termination_log(tmp_path, argv, fragment):
    log = tmp_path / "termination-log"
    proc = subprocess.run(
        [sys.executable, "-m", "shardline_runtime", "serve", "--model-path", "/m", *argv],
        env={"SHARDLINE_TERMINATION_LOG": str(log), "PYTHONPATH": "runtime", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert fragment in log.read_text()
    assert "shardline-runtime serve: error:" in proc.stderr  # the message still reaches the container log


def test_sections_hold_the_fields_and_flat_reads_match():
    args = ServerArgs.from_cli(["--model-path", "/m", "--tp-size", "2", "--cuda-graph-max-bs", "8"])
    assert args.parallel.tp_size == 2
    assert args.graphs.cuda_graph_max_bs == args.cuda_graph_max_bs


def test_max_prefill_tokens_is_raised_to_the_chunk_size():
    args = ServerArgs.from_cli(["--model-path", "/m", "--chunked-prefill-size", "20000", "--max-prefill-tokens", "100"])
    assert args.schedule.max_prefill_tokens == 20000


def test_lora_paths_imply_enable_lora():
    assert ServerArgs(model_path="/m", lora_paths=["a=/adapters/a"]).lora.enable_lora is True


@pytest.mark.parametrize("name", ["tiny", "/m"])
def test_lora_paths_refuse_the_served_model_name(name):
    # an adapter named like the base model is unreachable: `model: tiny` selects the base
    with pytest.raises(ServerArgsError, match="served model's name"):
        ServerArgs(model_path="/m", served_model_name="tiny", lora_paths=[f"{name}=/adapters/a"])


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="cuda_graph_max_batch"):
        ServerArgs(model_path="/m", cuda_graph_max_batch=8)


def test_pickles_for_the_scheduler_processes():
    import pickle

    args = ServerArgs(model_path="/m", tp_size=2, api_key="k")
    assert pickle.loads(pickle.dumps(args)) == args


def test_replace_revalidates():
    with pytest.raises(ServerArgsError, match="--node-rank"):
        ServerArgs(model_path="/m").replace(node_rank=3)


def test_keys_stay_out_of_repr():
    assert "secret-key" not in repr(ServerArgs(model_path="/m", api_key="secret-key"))
