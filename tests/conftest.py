import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MPLBACKEND", "Agg")
# Note [Calibrated rates]: tests plan by the built-in table, whatever this machine's calibration says
os.environ["ATTNLAB_CALIBRATION"] = "off"
# ... and a test that turns calibration on (with an empty cache folder) finds no shipped rate table either (Note
# [Shipped rate tables]): tests/functional/test_shipped_rates.py gives the tables it tests, and checks the real ones
from attnlab.kernels import rates as _rates  # noqa: E402

# (an empty folder of this process, removed at its exit: none left behind in /tmp)
_rates.TABLES = __import__("pathlib").Path(__import__("tempfile").mkdtemp(prefix="attnlab-no-rate-tables-"))
__import__("atexit").register(__import__("shutil").rmtree, _rates.TABLES, True)
torch.set_num_threads(1) if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensors: two threads on a busy 2-core machine stall in
    every parallel region. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def no_grad():
    """Autograd off for a whole module of inference tests (MiniLM, HF models): no graph is built or kept.
    Use with ``pytestmark = pytest.mark.usefixtures("no_grad")``."""
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def minilm_model():
    """attnlab's all-MiniLM-L6-v2 (``attnlab.models.minilm.load()``, default mechanism), loaded once per test
    module: a module may change its mechanism, so modules do not share one."""
    from attnlab.models import minilm

    return minilm.load()


@pytest.fixture(scope="module")
def hf_bert():
    """Hugging Face's BertModel on the same MiniLM checkpoint folder, eager attention, eval mode: the oracle
    for attnlab's MiniLM. Loaded once per test module (a module may switch its attention implementation)."""
    transformers = pytest.importorskip("transformers")
    from attnlab.models import minilm

    return transformers.BertModel.from_pretrained(str(minilm.model_path()), local_files_only=True,
                                                  attn_implementation="eager").eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# Integration tests that take seconds each (subprocesses, training runs, benchmarks, MiniLM, browsers)
# are marked slow here in one table, so `make test-fast` (-m "not slow") stays under a minute.
SLOW_MODULES = {
    "test_bench_all", "test_bench_core", "test_bench_layers", "test_browser", "test_distributed",
    "test_distributed_bench", "test_distributed_ring", "test_experiments", "test_approximation",
    "test_retrieve", "test_retrieve_minilm", "test_heads", "test_minilm_bench", "test_trace_minilm",
    "test_hf", "test_tour", "test_capture", "test_bench_kernels",
}
SLOW_TESTS = {"test_png_heatmaps", "test_cli_viz", "test_bert_attentions_round_trip",
              "test_fixed_pattern_skips_work_on_narrow_key_blocks",
              "test_list_shows_every_mechanism_with_its_spec", "test_cli_formats_and_failure_switches",
              "test_ring_attention_causal_negative_scale", "test_generate_runs_from_its_config_alone_and_prints_nothing",
              "test_cli_face_renders_progress_on_stderr_and_the_result_on_stdout",
              "test_instruments_run_from_configs_without_output"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per CPU-specific code path: ran, failed, or skipped and why (attnlab.verify.paths)."""
    from attnlab import cpu
    from attnlab.verify import paths

    outcomes = [o for key in ("passed", "failed", "skipped", "error") for r in terminalreporter.stats.get(key, [])
                if hasattr(r, "nodeid") and hasattr(r, "when") and (o := paths.from_pytest_report(r)) is not None]
    tr = terminalreporter
    tr.section(f"CPU paths on this machine: {cpu.summary(peaks=False)}")
    for line in paths.summary(outcomes, cpu.INFO.flags):
        tr.write_line(line)
