"""`mirrax.experimental.scaling_report` and `mirrax report`: the collectives, bytes and memory
it reads from the compiled step against hand arithmetic, its link model's arithmetic, the CLI
(table, JSON, plot) and the errors for bad inputs. Times are never asserted, only the
arithmetic the report does with the time it measured.

The model: an MLP 8 -> 8 -> 4, P = 8*8 + 8 + 8*4 + 4 = 108 float32 parameters, so the
gradients are G = 4 * 108 = 432 bytes; every parameter array has a first dimension that 1, 2
and 4 divide, so a sharded optimizer state splits completely at those replica counts.
"""

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrax
from mirrax import errors
from mirrax._src.cli.main import main
from mirrax.experimental import LinkModel, scaling_report

pytestmark = [pytest.mark.xdist_group("scaling_report"), pytest.mark.slow]

PARAMS = 8 * 8 + 8 + 8 * 4 + 4  # 108
GRADIENT_BYTES = 4 * PARAMS  # 432
ADAM_BYTES = 2 * GRADIENT_BYTES + 4  # mu and nu, float32 like the parameters, and an int32 count
# 1 GB/s, 10 µs per ring step, 5 µs per collective: easy numbers to check by hand.
LINK = LinkModel("test", bandwidth_gbps=1.0, latency_us=10.0, base_latency_us=5.0)
_RNG = np.random.default_rng(0)
BATCH = (_RNG.standard_normal((4, 8)).astype(np.float32), _RNG.integers(0, 4, 4).astype(np.int32))


class MLP(nnx.Module):
    def __init__(self):
        self.l1 = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(8, 4, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def train_step(model, optimizer, batch):
    x, y = batch

    def loss_fn(model):
        losses = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrax.compute_average_loss(losses)

    loss, grads = mirrax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _objects():
    model = MLP()
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


@pytest.fixture(scope="module")
def report():
    # 8 replicas on 4 of this process's devices: rows 1, 2, 4 compiled, 8 extrapolated.
    return scaling_report(
        train_step, BATCH, _objects(), max_replicas=8, link=LINK, timing_windows=1, devices=jax.devices()[:4]
    )


@pytest.fixture(scope="module")
def sharded_report():
    return scaling_report(
        train_step,
        BATCH,
        _objects(),
        max_replicas=2,
        link=LINK,
        overlap=0.5,
        shard_optimizer_state=True,
        timing_windows=1,
    )


def test_the_collectives_move_the_gradient_bytes_once(report):
    rows = {row.replicas: row for row in report.rows}
    assert list(rows) == [1, 2, 4, 8]
    assert report.gradient_bytes == GRADIENT_BYTES and report.parameters == PARAMS
    for n in (2, 4, 8):
        # XLA's combiner packs the 4 gradient arrays into ONE all-reduce of 432 bytes.
        assert rows[n].collectives == {"all-reduce": (1, GRADIENT_BYTES)}
        assert rows[n].payload_bytes == GRADIENT_BYTES
        # A ring all-reduce sends 2(N-1)/N of it per device: 432, 648, 756 bytes.
        assert rows[n].sent_bytes == pytest.approx(2 * (n - 1) / n * GRADIENT_BYTES)
        assert rows[n].sent_bytes == pytest.approx(rows[n].minimum_sent_bytes)
        assert rows[n].global_batch == 4 * n
    assert rows[1].sent_bytes == 0
    assert [rows[n].source for n in (1, 2, 4)] == ["compiled"] * 3
    assert rows[8].source == "extrapolated from 4"


def test_memory_is_the_hand_arithmetic_of_params_and_adam(report):
    # Sharded: 1/N of mu and nu where an array's dimension N divides, the count whole. At 1, 2
    # and 4 replicas every array splits: 2 * 432 / N + 4 = 868, 436, 220 bytes. At 8 the
    # (4,) bias of l2 stays whole: mu = 64/8 + 8/8 + 32/8 + 4 = 17 floats, 2 * 17 * 4 + 4 = 140.
    sharded = {1: 868, 2: 436, 4: 220, 8: 140}
    for row in report.rows:
        n = row.replicas
        plain, split = row.memory["unsharded"], row.memory["sharded"]
        assert plain.params_bytes == split.params_bytes == GRADIENT_BYTES
        assert plain.optimizer_state_bytes == ADAM_BYTES  # 2 * 432 + 4 = 868
        assert split.optimizer_state_bytes == sharded[n]
        assert plain.batch_bytes == 4 * 8 * 4 + 4 * 4  # x (4, 8) float32, y (4,) int32
        # The compiled programs agree: their arguments differ by the sharded-away state
        # (at 8, extrapolated: recounted the same way).
        assert plain.argument_bytes - split.argument_bytes == ADAM_BYTES - sharded[n]


def test_the_step_time_is_the_link_arithmetic_on_the_measured_step(report):
    t1 = report.one_device_ms
    assert report.rows[0].step_ms == t1 and report.rows[0].speedup == 1.0
    row = report.rows[2]  # 4 replicas, one all-reduce of 432 bytes
    # 5 µs + 2*3 steps * 10 µs + 2*3/4 * 432 B / 1e9 B/s = 65 µs + 0.648 µs = 0.065648 ms
    assert row.communication_ms == pytest.approx(0.065648)
    assert row.step_ms == pytest.approx(t1 + 0.065648)
    assert row.speedup == pytest.approx(4 * t1 / (t1 + 0.065648))
    assert row.efficiency == pytest.approx(row.speedup / 4)
    assert LINK.seconds("reduce-scatter", 1e6, 4) == pytest.approx(5e-6 + 3 * 10e-6 + 0.75e-3)
    # Gloo's way: a combined all-reduce of 10 arrays pays the 2 ring steps of each of them.
    gloo = LinkModel("gloo", bandwidth_gbps=1.0, latency_us=10.0, per_operand=True)
    assert gloo.seconds("all-reduce", 1e6, 2, operands=10) == pytest.approx(
        10 * 2 * 10e-6 + 1e6 / 1e9
    )  # 0.2 ms + 1 ms


def test_sharded_state_is_one_over_r_with_reduce_scatter_and_all_gather(sharded_report):
    row = sharded_report.rows[1]  # 2 replicas
    kinds = {kind: payload for kind, (_, payload) in row.collectives.items()}
    # mirrax.value_and_grad reduce-scatters the gradients; the new parameters are gathered.
    assert kinds == {"reduce-scatter": GRADIENT_BYTES, "all-gather": GRADIENT_BYTES}
    # (2-1)/2 of each: 216 + 216 = 432 bytes sent, an all-reduce's.
    assert row.sent_bytes == pytest.approx(row.minimum_sent_bytes) == GRADIENT_BYTES
    assert row.memory["sharded"].optimizer_state_bytes == GRADIENT_BYTES + 4  # 864 / 2 + 4
    # Each instruction: 5 µs + 1 step * 10 µs + 1/2 of its payload at 1 GB/s.
    instructions = sum(n for n, _ in row.collectives.values())
    communication_ms = instructions * 0.015 + GRADIENT_BYTES / 1e9 * 1e3
    assert row.communication_ms == pytest.approx(communication_ms)
    # overlap 0.5: half of the communication hides behind the compute, but never more than the
    # compute itself. The compute is 2 replicas' sharing this machine's cores (one device's at
    # least) and is measured, so which bound holds depends on the machine: on a fast one the
    # step measures under communication / 2 (e.g. 8 instructions: 0.06 ms) and the step is then the
    # communication alone.
    compute_ms = row.compute_ms
    assert compute_ms >= sharded_report.one_device_ms
    if compute_ms >= communication_ms / 2:
        assert row.step_ms == pytest.approx(compute_ms + communication_ms / 2)
    else:
        assert row.step_ms == pytest.approx(communication_ms)


def test_the_table_json_and_caller_objects(report):
    text = str(report)
    assert "extrapolated from 4" in text and "Assumptions:" in text
    assert "Weak scaling" in text and "Overlap: 0" in text
    data = json.loads(report.to_json())
    assert [r["replicas"] for r in data["rows"]] == [1, 2, 4, 8]
    assert data["rows"][1]["collectives"] == {
        "all-reduce": {"instructions": 1, "payload_bytes": GRADIENT_BYTES}
    }
    assert data["link"]["bandwidth_gbps"] == 1.0


def test_the_callers_objects_are_not_changed():
    model, optimizer = _objects()
    before = [np.asarray(a).copy() for a in jax_leaves((model, optimizer))]
    scaling_report(train_step, BATCH, (model, optimizer), max_replicas=1, timing_windows=1)
    after = [np.asarray(a) for a in jax_leaves((model, optimizer))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert int(optimizer.step[...]) == 0


def jax_leaves(objects):
    return jax.tree.leaves(nnx.state(objects))


def test_cli_prints_json_and_writes_the_plot(capsys, tmp_path):
    png = tmp_path / "speedup.png"
    assert main(["report", "--max-replicas", "4", "--json", "--plot", str(png), "--timing-windows", "1"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    # The tutorial CNN on 8x8 digits: conv 3*3*1*32 + 32, conv 3*3*32*64 + 64,
    # conv 3*3*64*64 + 64, dense (2*2*64)*64 + 64, dense 64*10 + 10 = 72,842 parameters.
    assert data["parameters"] == 72_842 and data["gradient_bytes"] == 4 * 72_842
    assert [r["replicas"] for r in data["rows"]] == [1, 2, 4]
    assert data["per_replica_batch"] == 16 and data["rows"][2]["global_batch"] == 64
    assert data["rows"][2]["sent_bytes"] == pytest.approx(2 * 3 / 4 * data["rows"][2]["payload_bytes"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote the speedup plot to {png}" in captured.err


@pytest.mark.parametrize(
    "kwargs, error, fragments",
    [
        (
            dict(link="nvlnk"),
            errors.InvalidArgumentError,
            ("unknown link 'nvlnk'", "nvlink, pcie, ethernet-100g, local", "bandwidth_gbps="),
        ),
        (
            dict(bandwidth_gbps=0),
            errors.InvalidArgumentError,
            ("bandwidth_gbps must be a finite number > 0 (GB/s); received 0", "e.g. 25"),
        ),
        (dict(bandwidth_gbps=-3.0), errors.InvalidArgumentError, ("received -3.0",)),
        (
            dict(latency_us=5.0),
            errors.InvalidArgumentError,
            ("latency_us=5.0 was given without a bandwidth", "Add bandwidth_gbps="),
        ),
        (
            dict(max_replicas=3),
            errors.InvalidArgumentError,
            ("max_replicas must be a power of two", "received 3. Use 2 or 4"),
        ),
        (
            dict(max_replicas=0),
            errors.InvalidArgumentError,
            ("max_replicas must be >= 1; received max_replicas=0",),
        ),
        (
            dict(max_replicas=4.0),
            errors.InvalidArgumentTypeError,
            ("max_replicas must be an int; received float 4.0", "max_replicas=4"),
        ),
        (dict(overlap=1.5), errors.InvalidArgumentError, ("in [0, 1]; received 1.5",)),
    ],
)
def test_bad_arguments_are_refused_before_any_work(kwargs, error, fragments):
    with pytest.raises(error) as info:
        scaling_report(train_step, BATCH, _objects(), **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_an_uncompiled_model_is_refused():
    with pytest.raises(
        errors.NotCompiledError, match=r"scaling_report: the model is not compiled\. Call model\.compile"
    ):
        scaling_report(mirrax.Model(MLP()), BATCH)


def test_a_batch_the_step_cannot_take_names_its_shapes():
    wide = (np.zeros((4, 9), np.float32), BATCH[1])  # 9 features for a first layer of 8
    with pytest.raises(errors.IncompatibleInputError) as info:
        scaling_report(train_step, wide, _objects(), max_replicas=1)
    message = str(info.value)
    assert "the step failed on the per-replica batch (float32[4, 9], int32[4])" in message
    assert "Pass one per-replica batch that the step accepts" in message
    assert info.value.__cause__ is not None


def test_a_batch_of_unequal_rows_is_refused():
    with pytest.raises(errors.InvalidBatchError, match=r"received shapes \(4, 8\), \(3,\)"):
        scaling_report(train_step, (BATCH[0], BATCH[1][:3]), _objects())
    with pytest.raises(errors.InvalidBatchError, match="batch is \\(x, y\\) or"):
        scaling_report(_compiled_model(), BATCH[0])


def _compiled_model():
    model = mirrax.Model(MLP())
    model.compile("adam", mirrax.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--max-replicas", "3"],
            "argument --max-replicas: expected a power of two >= 1 (1, 2, 4, 8, ...), received '3'",
        ),
        (["--max-replicas", "0"], "received '0'"),
        (["--link", "nvlnk"], "argument --link: invalid choice: 'nvlnk'"),
        (["--bandwidth", "0"], "argument --bandwidth: expected a finite number > 0"),
        (["--latency", "-1"], "argument --latency: expected a finite number >= 0"),
        (["--overlap", "2"], "argument --overlap: expected a number from 0 to 1"),
        # Before: refused by scaling_report, after loading the data and building the model (20 s).
        (
            ["--latency", "5"],
            "--latency 5 was given without --bandwidth; a link needs both. Add --bandwidth GB/S",
        ),
        (
            ["--link", "local", "--bandwidth", "3"],
            "--link local is measured on this machine, so it "
            "takes no numbers; received --bandwidth 3. Drop --bandwidth 3",
        ),
    ],
)
def test_cli_bad_arguments_exit_2_naming_the_value(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_plot_suffix_that_is_no_image_format_before_any_work(capsys, tmp_path, monkeypatch):
    from mirrax._src.cli import report as cli_report

    # Before: the whole report ran, then PNG bytes were written to out.txt.
    monkeypatch.setattr(cli_report, "report", lambda args: pytest.fail("the report ran"))
    assert main(["report", "--plot", str(tmp_path / "out.txt")]) == 1
    assert (
        "mirrax report: error: plot: the file's suffix names its format, one of .png, "
        ".svg, .pdf; received" in capsys.readouterr().err
    )
    assert not (tmp_path / "out.txt").exists()


def test_the_plot_is_written_in_the_format_its_suffix_names(report, tmp_path):
    # Each format's signature: PNG's 8 bytes, SVG's XML prologue, PDF's header (before: PNG
    # bytes under every name).
    for name, signature in (("s.svg", b"<?xml"), ("s.PDF", b"%PDF-"), ("s.png", b"\x89PNG\r\n\x1a\n")):
        report.plot(tmp_path / name)
        assert (tmp_path / name).read_bytes().startswith(signature), name


def test_a_bare_module_is_refused_with_the_mirrax_model_route():
    # Before: the module ran as the step on the (x, y) tuple and JAX said "Cannot concatenate
    # arrays with different numbers of dimensions".
    with pytest.raises(
        errors.InvalidArgumentTypeError,
        match=r"step_or_model is a bare model \(MLP\).*Wrap it in a compiled "
        r"mirrax\.Model: model = mirrax\.Model\(module\)",
    ):
        scaling_report(MLP(), BATCH)
    keras = pytest.importorskip("keras")
    dense = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    with pytest.raises(errors.InvalidArgumentTypeError, match=r"bare model \(Sequential\)"):
        scaling_report(dense, BATCH)


def test_the_hlo_reader_takes_the_outputs_of_asynchronous_starts_and_fp8_sizes():
    from mirrax._src.report import hlo

    text = "\n".join(
        [
            "  %ag = (f32[128], f32[1024]) all-gather-start(f32[128] %p), dimensions={0}",
            "  %cp = (f8e4m3fn[64], f8e4m3fn[64], u32[], u32[]) collective-permute-start(f8e4m3fn[64] %q)",
            "  %ar = f32[10] all-reduce(f32[10] %r), to_apply=%add",
        ]
    )
    ops = hlo.collectives(text)
    # all-gather-start's (operand, output): the 1024-float output, 4 * 1024 bytes, not + 4 * 128;
    # collective-permute-start's output: 64 one-byte floats; the all-reduce: 4 * 10.
    assert [hlo.payload_bytes(opcode, arrays, 8) for opcode, arrays in ops] == [4096, 64, 40]


def test_a_folder_given_as_the_plot_is_refused_before_any_work(tmp_path):
    from mirrax._src.report import plot

    with pytest.raises(errors.ExistingPathError, match=r"is a folder; give the path of the PNG"):
        plot.check_path(tmp_path)


def test_batch_bytes_count_what_the_device_receives():
    from mirrax._src.report import subject

    model, optimizer = _objects()
    study = subject.from_step(train_step, (np.zeros((4, 8)), np.zeros(4, np.int64)), (model, optimizer), None)
    # float64 and int64 on the host are float32 and int32 on the device (x64 off):
    # 4 * 8 * 4 + 4 * 4 = 144 bytes, not the host's 288.
    assert study.batch_bytes == 144
