"""The systems ours is compared with: Hugging Face transformers (PyTorch `generate()`), Optimum
(`ORTModelForCausalLM` / `ORTModelForSeq2SeqLM`, exported locally) on the same HF models (same config, same random
weights), and ONNX Runtime GenAI running OUR exported GPT graph (bench/genai_system.py). Each
`run_<system>_<task>(spec, runtime, workdir)` builds its model (untimed) and returns a GenerateFn."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .ours import ours_gpt_version
from .workloads import BOS_ID, EOS_ID, PAD_ID, GenerateFn, GptSpec, Runtime, TranslationSpec, seed_torch, spec_dir


def hf_gpt_model(spec: GptSpec):
    import transformers

    config = transformers.GPT2Config(
        vocab_size=spec.vocab_size, n_positions=spec.context_length, n_embd=spec.d_model, n_layer=spec.n_layers,
        n_head=spec.n_heads, n_inner=spec.d_ff, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    seed_torch(0)
    return transformers.GPT2LMHeadModel(config).eval()


def hf_translation_model(spec: TranslationSpec):
    import transformers

    config = transformers.MarianConfig(
        vocab_size=spec.vocab_size, d_model=spec.d_model,
        encoder_layers=spec.n_encoder_layers, decoder_layers=spec.n_decoder_layers,
        encoder_attention_heads=spec.n_heads, decoder_attention_heads=spec.n_heads,
        encoder_ffn_dim=spec.d_ff, decoder_ffn_dim=spec.d_ff, activation_function="relu",
        max_position_embeddings=spec.max_positions, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )
    seed_torch(0)
    return transformers.MarianMTModel(config).eval()


def gpt_generation_config(spec: GptSpec):
    """Greedy, exactly `new_tokens` tokens: min_new_tokens == max_new_tokens keeps EOS masked every step."""
    import transformers

    return transformers.GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID, use_cache=True,
    )


def translation_generation_config(spec: TranslationSpec):
    """Beam search, exactly `new_tokens` tokens (EOS masked until the last step), length_penalty 1, 1 result."""
    import transformers

    return transformers.GenerationConfig(
        do_sample=False, num_beams=spec.num_beams, num_return_sequences=1, length_penalty=1.0,
        early_stopping=False, max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None, use_cache=True,
    )


def _optimum_export(model, onnx_dir: Path, task: str) -> Path:
    """Save `model` (random weights) and export it with Optimum's exporter, once per spec (cached in onnx_dir)."""
    done = onnx_dir / ".exported"
    if done.exists():
        return onnx_dir
    from optimum.exporters.onnx import main_export

    hf_dir = onnx_dir.with_name(onnx_dir.name + "-hf")
    model.save_pretrained(hf_dir)
    main_export(str(hf_dir), output=onnx_dir, task=task, device="cpu", do_validation=False, local_files_only=True,
                library_name="transformers")
    done.touch()
    return onnx_dir


def run_transformers_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch

    model = hf_gpt_model(spec)
    generation_config = gpt_generation_config(spec)

    def generate(prompts: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(prompts)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=(ids != PAD_ID).long(),
                                 generation_config=generation_config)
        return out[:, ids.shape[1]:].numpy()

    return generate


def run_optimum_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    onnx_dir = _optimum_export(hf_gpt_model(spec), spec_dir(workdir, "optimum-gpt", spec), "text-generation-with-past")
    model = ORTModelForCausalLM.from_pretrained(onnx_dir, provider="CPUExecutionProvider", use_cache=True,
                                                session_options=runtime.session_options(), local_files_only=True)
    generation_config = gpt_generation_config(spec)

    def generate(prompts: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(prompts)
        out = model.generate(input_ids=ids, attention_mask=(ids != PAD_ID).long(),
                             generation_config=generation_config)
        return out[:, ids.shape[1]:].numpy()

    return generate


def run_genai_gpt(spec: GptSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    """ONNX Runtime GenAI on OUR exported GPT graph (the file `run_ours_gpt` loads), see bench/genai_system.py."""
    import genai_system
    import onnxruntime_genai  # noqa: F401 - ImportError here: reported as skipped

    version = ours_gpt_version(spec, workdir)
    folder = genai_system.prepare_folder(
        version.path, version.config, spec_dir(workdir, "genai-gpt", spec), threads=runtime.threads,
        spin=runtime.spin, max_length=spec.prompt_tokens + spec.new_tokens, pad_id=PAD_ID, bos_id=BOS_ID)
    return genai_system.make_generate(folder, spec.new_tokens)


def run_transformers_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch

    model = hf_translation_model(spec)
    generation_config = translation_generation_config(spec)

    def generate(source: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(source)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=(ids != PAD_ID).long(),
                                 generation_config=generation_config)
        return out[:, 1:].numpy()  # drop the decoder start token

    return generate


def run_optimum_translation(spec: TranslationSpec, runtime: Runtime, workdir: Path) -> GenerateFn:
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    onnx_dir = _optimum_export(hf_translation_model(spec), spec_dir(workdir, "optimum-translation", spec),
                               "text2text-generation-with-past")
    model = ORTModelForSeq2SeqLM.from_pretrained(onnx_dir, provider="CPUExecutionProvider", use_cache=True,
                                                 session_options=runtime.session_options(),
                                                 local_files_only=True)
    generation_config = translation_generation_config(spec)

    def generate(source: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(source)
        out = model.generate(input_ids=ids, attention_mask=(ids != PAD_ID).long(),
                             generation_config=generation_config)
        return out[:, 1:].numpy()

    return generate
