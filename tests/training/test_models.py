"""The seed's measured facts about the architecture, checked against the project's own modules."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from models.config import GPTConfig, TranslationConfig, ViTConfig
from models.gpt import GPT
from models.layers import DecoderBlock, TransformerBlock, sinusoidal_table
from models.transformer import EncoderDecoderTransformer
from models.vit import ViT


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- sinusoidal positional encoding -------------------------------------------------------------------------

def test_positional_encoding_is_bounded():
    table = sinusoidal_table(1000, 64)
    assert table.min() >= -1.0 and table.max() <= 1.0
    assert torch.allclose(table[0, 0::2], torch.zeros(32)) and torch.allclose(table[0, 1::2], torch.ones(32))


def test_positional_dot_product_depends_only_on_offset():
    table = sinusoidal_table(200, 16, dtype=torch.float64)
    for k, expected in [(0, 8.000), (1, 7.485), (2, 6.368)]:
        dots = torch.stack([table[p] @ table[p + k] for p in range(0, 150, 7)])
        assert torch.allclose(dots, torch.full_like(dots, dots[0].item()), atol=1e-9)
        assert dots[0].item() == pytest.approx(expected, abs=5e-4)


def test_one_linear_map_shifts_every_position():
    table = sinusoidal_table(300, 16, dtype=torch.float64).numpy()
    shift = 7
    seen, unseen = np.arange(0, 100), np.arange(150, 290)
    matrix, *_ = np.linalg.lstsq(table[seen], table[seen + shift], rcond=None)
    error = np.abs(table[unseen] @ matrix - table[unseen + shift]).max()
    assert error < 1e-6


# --- parameter counts ---------------------------------------------------------------------------------------

def test_encoder_layer_parameter_count():
    count = n_params(TransformerBlock(512, 8, 2048))
    assert count == 3_152_384
    assert count / 512**2 == pytest.approx(12.025, abs=1e-3)


def test_decoder_layer_parameter_count():
    count = n_params(DecoderBlock(512, 8, 2048))
    assert count == 4_204_032
    assert count / 512**2 == pytest.approx(16.037, abs=1e-3)


# --- masks --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def translator() -> EncoderDecoderTransformer:
    torch.manual_seed(0)
    config = TranslationConfig(vocab_size=100, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                               d_ff=64, dropout=0.0, max_positions=64)
    return EncoderDecoderTransformer(config).eval()


def _decoder_outputs(model, src, tgt):
    src_mask, tgt_mask = torch.ones_like(src, dtype=torch.bool), torch.ones_like(tgt, dtype=torch.bool)
    with torch.no_grad():
        return model(src, tgt, src_mask, tgt_mask)


def test_changing_the_last_target_token_leaves_earlier_outputs_unchanged(translator):
    src, tgt = torch.randint(4, 100, (1, 9)), torch.randint(4, 100, (1, 8))
    changed = tgt.clone()
    changed[0, -1] = (tgt[0, -1] + 1) % 100
    before, after = _decoder_outputs(translator, src, tgt), _decoder_outputs(translator, src, changed)
    assert torch.equal(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_changing_one_source_token_changes_every_decoder_output(translator):
    src, tgt = torch.randint(4, 100, (1, 9)), torch.randint(4, 100, (1, 8))
    changed = src.clone()
    changed[0, 4] = (src[0, 4] + 1) % 100
    before, after = _decoder_outputs(translator, src, tgt), _decoder_outputs(translator, changed, tgt)
    assert ((before - after).abs().amax(-1) > 1e-6).all()


def test_source_padding_is_invisible(translator):
    src, tgt = torch.randint(4, 100, (1, 6)), torch.randint(4, 100, (1, 5))
    padded = torch.cat([src, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    padded_mask = torch.cat([torch.ones(1, 6, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        plain = translator(src, tgt, torch.ones_like(src, dtype=torch.bool), torch.ones_like(tgt, dtype=torch.bool))
        masked = translator(padded, tgt, padded_mask, torch.ones_like(tgt, dtype=torch.bool))
    torch.testing.assert_close(plain, masked, atol=1e-5, rtol=1e-5)


# --- KV cache -----------------------------------------------------------------------------------------------

def test_translator_cached_steps_equal_full_recomputation(translator):
    src, tgt = torch.randint(4, 100, (2, 7)), torch.randint(4, 100, (2, 9))
    src_mask = torch.ones_like(src, dtype=torch.bool)
    src_mask[1, 5:] = False
    tgt_mask = torch.ones_like(tgt, dtype=torch.bool)
    with torch.no_grad():
        full = translator(src, tgt, src_mask, tgt_mask)
        cross = translator.cross_attention_kv(translator.encode(src, src_mask))
        positions = torch.arange(9).expand(2, 9)
        logits, past, steps = None, None, []
        for t in range(9):  # one token at a time
            logits, past = translator.decode_step(tgt[:, t : t + 1], positions[:, t : t + 1], tgt_mask[:, : t + 1],
                                                  cross, src_mask, past)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert past[0][0].shape == (2, 4, 9, 8)  # (B, H, T, Dh)


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, context_length=32, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                         dropout=0.0)).eval()


def test_gpt_cached_steps_equal_full_recomputation(gpt):
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full, _ = gpt(ids)
        prompt_logits, past = gpt(ids[:, :5])
        steps = [prompt_logits]
        for t in range(5, 12):
            logits, past = gpt(ids[:, t : t + 1], past_key_values=past)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_gpt_left_padded_row_matches_its_unpadded_self(gpt):
    """A ragged batch: row 1 is left-padded by 3 with explicit positions and mask, and gives its own logits."""
    ids = torch.randint(0, 50, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        alone, _ = gpt(ids)
        batched, _ = gpt(padded, position_ids=positions, attention_mask=mask)
    torch.testing.assert_close(batched[:, 3:], alone, atol=1e-5, rtol=1e-5)


def test_gpt_head_is_tied_to_the_token_embedding(gpt):
    assert not any("head" in name for name, _ in gpt.named_parameters())
    captured = {}
    handle = gpt.norm.register_forward_hook(lambda module, inputs, output: captured.update(hidden=output))
    with torch.no_grad():
        logits, _ = gpt(torch.randint(0, 50, (1, 4)))
    handle.remove()
    torch.testing.assert_close(logits, captured["hidden"] @ gpt.token_embedding.weight.T)


# --- ViT ----------------------------------------------------------------------------------------------------

def test_conv_patch_embedding_equals_flatten_and_linear():
    torch.manual_seed(0)
    vit = ViT(ViTConfig(image_size=224, patch_size=16, channels=3, d_model=64, n_heads=4, n_layers=1, d_ff=64,
                        dropout=0.0)).eval()
    images = torch.randn(2, 3, 224, 224)
    conv = vit.patch_embed(images).flatten(2).transpose(1, 2)  # (B, 196, d)
    patches = images.unfold(2, 16, 16).unfold(3, 16, 16)  # (B, C, 14, 14, 16, 16)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(2, 196, 3 * 16 * 16)  # (B, N, C*p*p)
    linear = patches @ vit.patch_embed.weight.reshape(64, -1).T + vit.patch_embed.bias
    torch.testing.assert_close(conv, linear, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        assert vit.forward_features(images).shape == (2, 197, 64)
        assert vit(images).shape == (2, 10)


@pytest.mark.parametrize("image_size, widths, grid", [(28, (8, 16, 32), 4), (28, (8, 16), 7), (32, (8, 8), 8)])
def test_a_conv_stem_halves_the_grid_per_convolution(image_size, widths, grid):
    config = ViTConfig(image_size=image_size, stem_widths=widths, d_model=32, n_heads=4, n_layers=1, d_ff=64,
                       dropout=0.0)
    vit = ViT(config).eval()
    images = torch.randn(2, 1, image_size, image_size)
    with torch.no_grad():
        assert vit.patch_embed(images).shape == (2, 32, grid, grid)
        assert vit.forward_features(images).shape == (2, 1 + grid * grid, 32)
        assert vit(images).shape == (2, 10)
    assert (config.grid_size, config.num_patches) == (grid, grid * grid)
    convolutions = [m for m in vit.patch_embed if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.stride) for c in convolutions] == [*((w, (2, 2)) for w in widths), (32, (1, 1))]


def test_a_conv_stem_vit_exports_with_its_batchnorm_statistics(tmp_path):
    """The exported graph computes the eval-mode stem (BatchNorm's running statistics, not the batch's)."""
    import onnxruntime as ort

    from export.onnx_export import export_vit
    from service.engines import onnx_schema as schema

    torch.manual_seed(0)
    config = ViTConfig(stem_widths=(8, 16, 32), d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0)
    vit = ViT(config).train()
    with torch.no_grad():
        for _ in range(5):  # running statistics away from their initial 0 / 1
            vit(torch.randn(16, 1, 28, 28) * 3 + 1)
    vit.eval()
    info = export_vit(vit, config, tmp_path)
    assert info["architecture"]["stem_widths"] == [8, 16, 32] and info["architecture"]["tokens"] == 16
    images = torch.randn(5, 1, 28, 28)
    session = ort.InferenceSession(str(tmp_path / schema.VIT_FILE), providers=["CPUExecutionProvider"])
    logits = session.run(None, {schema.PIXEL_VALUES: images.numpy()})[0]
    with torch.no_grad():
        expected = vit(images).numpy()
        in_batch_statistics = vit.train()(images).numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    assert np.abs(in_batch_statistics - expected).max() > 1e-2  # the statistics matter: the check would see them


def test_flip_averaging_averages_the_image_and_its_mirror_in_eval_mode_only():
    torch.manual_seed(0)
    plain_config = ViTConfig(patch_size=7, d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0)
    plain = ViT(plain_config).eval()
    flipping = ViT(replace(plain_config, flip_average=True))
    flipping.load_state_dict(plain.state_dict())
    images = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        expected = (plain(images) + plain(images.flip(-1))) / 2
        torch.testing.assert_close(flipping.eval()(images), expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(flipping(images.flip(-1)), flipping(images), atol=1e-6, rtol=1e-6)
        assert not torch.allclose(plain(images), expected, atol=1e-4)  # the mirror image changes the logits
        torch.testing.assert_close(flipping.train()(images), plain(images))  # training sees one image


def test_a_flip_averaging_vit_exports_its_averaging(tmp_path):
    import onnxruntime as ort

    from export.onnx_export import export_vit
    from service.engines import onnx_schema as schema

    torch.manual_seed(0)
    config = ViTConfig(patch_size=7, d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0, flip_average=True)
    vit = ViT(config).eval()
    info = export_vit(vit, config, tmp_path)
    assert info["architecture"]["flip_average"] is True
    session = ort.InferenceSession(str(tmp_path / schema.VIT_FILE), providers=["CPUExecutionProvider"])
    for rows in (1, 5):  # the batch axis stays dynamic through the concatenation and the averaging
        images = torch.randn(rows, 1, 28, 28)
        logits = session.run(None, {schema.PIXEL_VALUES: images.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(logits, vit(images).numpy(), atol=1e-4)


def test_fused_training_attention_equals_written_out_attention(translator):
    """Training runs PyTorch's fused attention, evaluation and export the written-out form: same numbers."""
    torch.manual_seed(0)
    src = torch.randint(4, 64, (3, 9))
    src[1, 6:] = 0  # padded source row
    tgt = torch.randint(4, 64, (3, 7))
    tgt[2, 5:] = 0  # padded target row
    src_mask, tgt_mask = src != 0, tgt != 0
    translator.eval()
    with torch.no_grad():
        written_out = translator(src, tgt, src_mask, tgt_mask)
        translator.train()  # dropout is 0 in this fixture, so train mode differs only by the attention kernel
        fused = translator(src, tgt, src_mask, tgt_mask)
    translator.eval()
    torch.testing.assert_close(fused, written_out, rtol=1e-5, atol=1e-5)
