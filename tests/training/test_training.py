"""Training: the tiny presets learn, runs are complete and resumable, and the seed's toy GPT reaches its floor."""

import json
import math
import random

import numpy as np
import pytest
import torch

from models import evaluate
from models.config import GPTConfig, TrainConfig
from models.gpt import GPT
from models.runs import load_trained
from models.tasks.gpt import GPTTask
from models.trainer import lr_factor, train

pytestmark = pytest.mark.slow


def read_metrics(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())


def test_tiny_translation_learned(tiny_runs):
    metrics = read_metrics(tiny_runs["translation"])
    assert metrics["val_loss"] < 0.7 * math.log(1000)  # uniform over the 1,000-id vocabulary: 6.91
    assert metrics["bleu"] > 2.0 and metrics["val_bleu"] > 2.0
    for split in ("val", "test_2016_flickr"):
        assert {f"bleu_{split}_greedy", f"bleu_{split}_beam4"} <= metrics.keys()


def test_tiny_gpt_learned(tiny_runs):
    metrics = read_metrics(tiny_runs["gpt"])
    assert metrics["val_loss"] < 0.6 * math.log(257)  # uniform over bytes + <|endoftext|>: 5.55
    assert metrics["val_perplexity"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-3)


def test_tiny_vit_learned(tiny_runs):
    assert read_metrics(tiny_runs["vit"])["test_accuracy"] > 50.0  # chance: 10%


@pytest.mark.parametrize("task", ["translation", "gpt", "vit"])
def test_run_folder_is_complete(tiny_runs, task):
    run_dir = tiny_runs[task]
    for name in ("config.json", "model.pt", "checkpoint.pt", "metrics.json", "history.json"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "tokenizer.json").is_file() == (task != "vit")
    loaded_task, model, config, tokenizer, saved = load_trained(run_dir)
    assert loaded_task == task and saved["preset"] == "tiny" and not model.training
    assert read_metrics(run_dir)["parameters"] == sum(p.numel() for p in model.parameters())


# What `python -m models.evaluate` is told to evaluate: the examples the tiny preset's own evaluation used, so that
# the figure it prints is the one training recorded (translation: its first 100 sentences; GPT: the first 20,000
# validation tokens, all 10,000 of the fixture's; ViT: all 500 fixture test images, as training evaluated them).
EVALUATE_LIMITS = {"translation": 100, "gpt": 20_000, "vit": 500}


@pytest.mark.parametrize("task", ["gpt", "vit", "translation"])
def test_evaluate_cli_reproduces_metrics(tiny_runs, data_dir, task, capsys):
    """The evaluation CLI, run again on the saved checkpoint over the same examples, prints the figure training
    recorded in metrics.json: GPT validation loss and BLEU within 1e-3 (the printed rounding), the ViT's test
    accuracy exactly (the same weights on the same 500 images: one image flipped would move it 0.2 points)."""
    run_dir = tiny_runs[task]
    assert evaluate.main([str(run_dir), "--data-dir", str(data_dir), "--limit", str(EVALUATE_LIMITS[task])]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = read_metrics(run_dir)
    key = {"gpt": "val_loss", "vit": "test_accuracy", "translation": "bleu"}[task]
    if task == "vit":
        assert saved["test_images"] == printed["test_images"] == EVALUATE_LIMITS["vit"]
        assert printed[key] == saved[key]
    else:
        assert printed[key] == pytest.approx(saved[key], abs=1e-3)


class _ScriptedValidation:
    """A ViT task whose validation accuracy depends only on the model's flip averaging."""

    held_out = 100

    def __init__(self, by_flip: dict[bool, float]):
        self.by_flip, self.tested_with = by_flip, []

    def validation_accuracy(self, model) -> float:
        return self.by_flip[model.config.flip_average]

    def evaluate(self, model) -> dict:
        self.tested_with.append(model.config.flip_average)
        return {"test_accuracy": 0.0}


@pytest.mark.parametrize("by_flip, chosen", [({False: 90.0, True: 90.2}, True), ({False: 90.2, True: 90.2}, False),
                                             ({False: 90.2, True: 90.0}, False)])
def test_vit_flip_averaging_is_chosen_on_validation_and_tested_once(by_flip, chosen):
    from models.config import ViTConfig
    from models.vit import ViT

    model = ViT(ViTConfig(patch_size=7, d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0))
    task = _ScriptedValidation(by_flip)
    metrics = evaluate.evaluate_vit(model, task)
    assert metrics["flip_average"] is chosen and model.config.flip_average is chosen
    assert task.tested_with == [chosen]  # the test set: once, with the choice
    assert metrics["val_accuracy_by_flip_average"] == {"false": by_flip[False], "true": by_flip[True]}


def test_a_trained_vit_loads_as_its_evaluation_chose(tiny_runs):
    metrics = read_metrics(tiny_runs["vit"])
    by_flip = metrics["val_accuracy_by_flip_average"]
    assert metrics["flip_average"] is (by_flip["true"] > by_flip["false"])
    _, model, config, _, saved = load_trained(tiny_runs["vit"])
    assert model.config.flip_average is config.flip_average is metrics["flip_average"]
    assert saved["model"]["flip_average"] is metrics["flip_average"]


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    from models.train import main

    missing = tmp_path / "nowhere"
    assert main(["gpt", "--preset", "tiny", "--data-dir", str(missing), "--out", str(tmp_path / "run")]) == 2
    assert str(missing) in capsys.readouterr().err


def test_learning_rate_schedule_warms_up_then_decays():
    cfg = TrainConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(step, cfg, total=100) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)
    inverse = TrainConfig(warmup_steps=25, schedule="inverse_sqrt")
    assert lr_factor(99, inverse, total=1000) == pytest.approx(0.5)  # sqrt(25 / 100)


# --- resume -------------------------------------------------------------------------------------------------

class Interrupting:
    """Wraps a task and raises after `after` batches, like a process killed mid-run."""

    def __init__(self, task, after):
        self.task, self.after, self.seen = task, after, 0

    def __getattr__(self, name):
        return getattr(self.task, name)

    def batches(self, epoch):
        for batch in self.task.batches(epoch):
            if self.seen == self.after:
                raise KeyboardInterrupt
            self.seen += 1
            yield batch


def _toy_task(config, cfg, text):
    ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)
    split = int(0.9 * len(ids))
    return GPTTask(config, cfg, ids[:split], ids[split:])


@pytest.mark.parametrize("ema_decay", [None, 0.9])
def test_interrupted_training_resumes_to_the_same_weights(tmp_path, ema_decay):
    config = GPTConfig(vocab_size=257, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.1)
    cfg = TrainConfig(epochs=3, batch_size=8, lr=3e-3, warmup_steps=5, checkpoint_every=4, eval_every=50,
                      ema_decay=ema_decay)
    text = "".join(random.Random(0).choice("abcd ") for _ in range(3000))

    torch.manual_seed(0)
    straight = GPT(config)
    train(straight, _toy_task(config, cfg, text), cfg, tmp_path / "straight", progress=False)

    torch.manual_seed(0)
    interrupted = GPT(config)
    task = _toy_task(config, cfg, text)
    steps = task.steps_per_epoch() * cfg.epochs
    with pytest.raises(KeyboardInterrupt):  # killed after 2 checkpoints + 1 step: the last step is lost
        train(interrupted, Interrupting(task, after=9), cfg, tmp_path / "resumed", progress=False)
    torch.manual_seed(123)  # a new process: fresh weights and RNG, everything comes from the checkpoint
    resumed = GPT(config)
    state = train(resumed, _toy_task(config, cfg, text), cfg, tmp_path / "resumed", progress=False)
    assert state.step == steps
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


class ScriptedValidation:
    """Wraps a task; its validation losses are the given numbers, in order."""

    def __init__(self, task, losses):
        self.task, self.losses = task, iter(losses)

    def __getattr__(self, name):
        return getattr(self.task, name)

    def validation_loss(self, model):
        return next(self.losses)


def test_keep_best_ends_with_the_weights_of_the_lowest_validation_loss(tmp_path):
    config = GPTConfig(vocab_size=257, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.0)
    text = "".join(random.Random(0).choice("abcd ") for _ in range(3000))
    # inverse_sqrt does not depend on the budget, so a 10-step run follows the first 10 steps of a 20-step run
    cfg = TrainConfig(epochs=100, max_steps=20, batch_size=8, lr=3e-3, warmup_steps=5, schedule="inverse_sqrt",
                      eval_every=5, checkpoint_every=100, keep_best=True)
    torch.manual_seed(0)
    kept = GPT(config)
    state = train(kept, ScriptedValidation(_toy_task(config, cfg, text), [3.0, 1.0, 2.0, 4.0]), cfg,
                  tmp_path / "kept", progress=False)
    assert (state.step, state.best_step, state.best_val_loss) == (20, 10, 1.0)

    torch.manual_seed(0)
    ten_steps = GPT(config)
    short = TrainConfig(**{**cfg.__dict__, "max_steps": 10, "keep_best": False})
    train(ten_steps, _toy_task(config, short, text), short, tmp_path / "ten", progress=False)
    for (name, a), b in zip(ten_steps.state_dict().items(), kept.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


class RecordingWeights:
    """Wraps a task; keeps a copy of the model's parameters each time a step starts (= after the previous step)."""

    def __init__(self, task):
        self.task, self.snapshots = task, []

    def __getattr__(self, name):
        return getattr(self.task, name)

    def loss(self, model, batch):
        self.snapshots.append([p.detach().clone() for p in model.parameters()])
        return self.task.loss(model, batch)


def _weights_after_each_step(config, cfg, text, folder) -> list[list[torch.Tensor]]:
    """A straight run of a seed-0 GPT on `text`: its parameters after each step, in order."""
    torch.manual_seed(0)
    model = GPT(config)
    recorder = RecordingWeights(_toy_task(config, cfg, text))
    train(model, recorder, cfg, folder, progress=False)
    return recorder.snapshots[1:] + [[p.detach().clone() for p in model.parameters()]]


def test_the_moving_average_is_what_training_evaluates_and_returns(tmp_path):
    config = GPTConfig(vocab_size=257, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.0)
    text = "".join(random.Random(0).choice("abcd ") for _ in range(3000))
    cfg = TrainConfig(epochs=100, max_steps=12, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=100,
                      checkpoint_every=100)
    trajectory = _weights_after_each_step(config, cfg, text, tmp_path / "raw")  # after steps 1..12

    decay = 0.8
    expected = trajectory[0]
    for weights in trajectory[1:]:
        expected = [decay * a + (1 - decay) * w for a, w in zip(expected, weights)]
    torch.manual_seed(0)
    averaged = GPT(config)
    with_average = TrainConfig(**{**cfg.__dict__, "ema_decay": decay})
    scripted = ScriptedValidation(_toy_task(config, with_average, text), [])
    evaluated = []
    scripted.validation_loss = lambda model: evaluated.append([p.detach().clone() for p in model.parameters()]) or 1.0
    train(averaged, scripted, with_average, tmp_path / "averaged", progress=False)
    for a, b in zip(expected, averaged.parameters()):
        torch.testing.assert_close(b.detach(), a)
    for a, b in zip(expected, evaluated[-1]):  # the curve's last point measured the average, not the raw weights
        torch.testing.assert_close(b, a)
    assert not torch.equal(trajectory[-1][0], expected[0])


def test_attention_dropout_is_separate_from_the_residual_dropout():
    model = GPT(GPTConfig(vocab_size=257, context_length=16, d_model=32, n_heads=2, n_layers=2, d_ff=64,
                          dropout=0.1, attention_dropout=0.0))
    assert [block.attn.dropout.p for block in model.blocks] == [0.0, 0.0]
    assert [block.dropout.p for block in model.blocks] == [0.1, 0.1] and model.dropout.p == 0.1
    same = GPT(GPTConfig(vocab_size=257, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.1))
    assert same.blocks[0].attn.dropout.p == 0.1


# --- the seed's toy language --------------------------------------------------------------------------------

def toy_sentences(n, seed):
    rng = random.Random(seed)
    return "".join(f"the {rng.choice(['cat', 'dog', 'bird'])} {rng.choice(['saw', 'chased', 'ate'])} "
                   f"the {rng.choice(['fish', 'ball', 'bone'])}. " for _ in range(n))


def test_toy_language_reaches_the_entropy_floor(tmp_path):
    """1,500 sentences, d=64, 4 heads, 2 layers, context 40, AdamW lr 3e-3, 600 steps: perplexity per character
    within 5% of the floor exp(3 ln 3 / 23.33) = 1.152 (the seed measured 1.192)."""
    config = GPTConfig(vocab_size=257, context_length=40, d_model=64, n_heads=4, n_layers=2, d_ff=256, dropout=0.0)
    cfg = TrainConfig(epochs=1000, max_steps=600, batch_size=32, lr=3e-3, warmup_steps=30, weight_decay=0.1,
                      betas=(0.9, 0.99), checkpoint_every=10_000, eval_every=600)
    train_ids = np.frombuffer(toy_sentences(1500, seed=1).encode(), dtype=np.uint8).astype(np.int64)
    val_ids = np.frombuffer(toy_sentences(300, seed=2).encode(), dtype=np.uint8).astype(np.int64)
    torch.manual_seed(0)
    model = GPT(config)
    train(model, GPTTask(config, cfg, train_ids, val_ids), cfg, tmp_path, progress=False)
    perplexity = math.exp(GPTTask(config, cfg, train_ids, val_ids).validation_loss(model))
    assert perplexity <= 1.152 * 1.05, perplexity


def test_average_last_returns_the_mean_of_the_last_evaluations_weights(tmp_path):
    """average_last 3: the returned weights are the mean of the weights at the last 3 evaluations (every 5 steps
    of 20: steps 10, 15 and 20), recorded from a straight run; older snapshots are deleted; its validation loss is
    the curve's `averaged_val_loss`."""
    config = GPTConfig(vocab_size=257, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64, dropout=0.0)
    text = "".join(random.Random(0).choice("abcd ") for _ in range(3000))
    cfg = TrainConfig(epochs=100, max_steps=20, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=5,
                      checkpoint_every=100)
    after = _weights_after_each_step(config, cfg, text, tmp_path / "plain")  # after[i]: after step i + 1

    torch.manual_seed(0)
    averaged = GPT(config)
    task = _toy_task(config, cfg, text)
    state = train(averaged, task, TrainConfig(**{**cfg.__dict__, "average_last": 3}), tmp_path / "avg", progress=False)
    assert sorted(p.name for p in (tmp_path / "avg" / "snapshots").iterdir()) == [
        "step-00000010.pt", "step-00000015.pt", "step-00000020.pt"]
    for index, parameter in enumerate(averaged.parameters()):
        expected = sum(after[step - 1][index].double() for step in (10, 15, 20)) / 3
        torch.testing.assert_close(parameter, expected.float())
    assert state.history["averaged_val_loss"] == [[20, pytest.approx(task.validation_loss(averaged))]]


@pytest.mark.parametrize("other", [{"ema_decay": 0.9}, {"keep_best": True}])
def test_average_last_refuses_the_other_weight_choices(tmp_path, other):
    config = GPTConfig(vocab_size=257, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    cfg = TrainConfig(max_steps=2, batch_size=8, average_last=3, **other)
    with pytest.raises(ValueError, match="average_last"):
        train(GPT(config), _toy_task(config, cfg, "abcd " * 200), cfg, tmp_path, progress=False)
