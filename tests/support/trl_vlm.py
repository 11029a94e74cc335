"""Tiny, offline VLM GRPO set-up for the TRL tests: a local processor (the family's image processor from keyword
arguments, a WordLevel tokenizer holding the model's special tokens at the model's ids, a chat template), a
conversational dataset with an ``image`` column, and the tiny models of :mod:`support.vlm`. Nothing downloaded.
"""

from __future__ import annotations

import torch

from support import vlm
from support.trl_fixtures import config, reward_even_words
from support.trl_fixtures import micro_batch as _text_micro_batch

# family -> {token: id} of the model's placeholder / marker tokens (the ids of support.vlm's tiny configs)
SPECIAL = {
    "qwen2_5_vl": {"<|image_pad|>": vlm.IMAGE, "<|video_pad|>": vlm.VIDEO, "<|vision_start|>": vlm.START,
                   "<|vision_end|>": vlm.END},
    "gemma3": {"<image_soft_token>": vlm.GEMMA_IMAGE, "<start_of_image>": vlm.BOI, "<end_of_image>": vlm.EOI},
}  # fmt: skip
SPECIAL["qwen3_vl"] = SPECIAL["qwen2_5_vl"]
IMAGE_PART = {
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",  # Gemma3Processor expands it to boi, image tokens, eoi
}
ROLES = ["user", "assistant"]
# every message: its role word, its text, an image's placeholder where the image part sits
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %} @IMAGE@ {% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def tokenizer(family: str):
    """A ``PreTrainedTokenizerFast`` over the model's 256 ids: pad 0, eos 1, unk 2, the role words, words
    ``w0...`` everywhere else, and the family's special tokens at the model's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL[family]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{r: 3 + i for i, r in enumerate(ROLES)}}
    free = [i for i in range(len(vocab), vlm.VOCAB) if i not in special.values()]
    vocab.update({f"w{k}": i for k, i in enumerate(free)})
    vocab.update(special)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = {
        "qwen2_5_vl": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                       "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
        "gemma3": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                   "eoi_token": "<end_of_image>"},
    }[family if family != "qwen3_vl" else "qwen2_5_vl"]  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        extra_special_tokens=names, padding_side="left",  # as TRL's from_pretrained loads a processor
    )  # fmt: skip


def processor(family: str):
    """The family's processor, built locally: its image processor sized for the tiny tower."""
    tok = tokenizer(family)
    template = TEMPLATE.replace("@IMAGE@", IMAGE_PART[family])
    if family == "gemma3":
        from transformers import Gemma3ImageProcessor, Gemma3Processor

        images = Gemma3ImageProcessor(
            size={"height": vlm.IMAGE_SIZE, "width": vlm.IMAGE_SIZE}, do_pan_and_scan=False
        )
        return Gemma3Processor(images, tok, chat_template=template, image_seq_length=vlm.PER_IMAGE)
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # the PIL image processor (the default one needs torchvision); no video processor (images only)
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 84 * 84}, patch_size=vlm.PATCH, merge_size=vlm.MERGE,
        temporal_patch_size=vlm.TPATCH,
    )  # fmt: skip
    base = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen3VLProcessor

    class ImagesOnly(base):
        """The family's processor without a video processor (transformers' needs torchvision): its sub-
        processors are those its ``__init__`` names."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImagesOnly(images, tok, chat_template=template)


SIZES = ((56, 56), (56, 84), (84, 56), (84, 84))  # Qwen: 4, 6, 6 and 9 image tokens; Gemma: all resized to 28


def dataset(n_prompts: int = 4, seed: int = 0, column: str = "image", same_text: bool = False):
    """Conversational prompts of different lengths, one random image each (``image``) or a list of one
    (``images``: TRL's other convention). ``same_text``: every prompt the same words and image size (different
    images behind the same token ids)."""
    from datasets import Dataset
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    prompts, pictures, words = [], [], []
    for i in range(n_prompts):
        if not same_text or i == 0:
            words = torch.randint(0, 40, (3 + 2 * i,), generator=gen).tolist()
        prompts.append([{"role": "user", "content": " ".join(f"w{j}" for j in words)}])
        w, h = SIZES[0 if same_text else i % len(SIZES)]
        pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        image = Image.fromarray(pixels)
        pictures.append(image if column == "image" else [image])
    return Dataset.from_dict({"prompt": prompts, column: pictures})


def model(family: str, seed: int = 0, dtype=torch.float32):
    """The tiny VLM of :mod:`support.vlm`; LM head scaled up (a peaked policy), eos 1 / pad 0 as the tokenizer."""
    m = vlm.build_gemma3(seed, dtype) if family == "gemma3" else vlm.build_qwen(family, seed, dtype)
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    m.generation_config.pad_token_id = 0
    m.generation_config.eos_token_id = 1
    m.generation_config.bos_token_id = None
    return m


def conditioned(model, seed: int = 0):
    """Re-draw the weights well-conditioned for fp32 comparisons (unit-gain matrices, norms 1, small random
    biases): support.vlm's fp64 weights amplify fp32 rounding past TRL's own layout-to-layout noise."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return model


def trl_grads(tr, inputs) -> tuple[float, dict]:
    """TRL's own ``compute_loss -> backward`` on the micro-batch: its loss and every parameter's gradient."""
    model = tr.model
    model.zero_grad(set_to_none=True)
    loss = tr.compute_loss(model, inputs)
    loss.backward()
    return float(loss.detach()), {
        n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
    }


def prefixflow_grads(tr, inputs) -> tuple[float, dict]:
    """PrefixFlow's update on the same micro-batch (checked first, as training_step does)."""
    model = tr.model
    model.zero_grad(set_to_none=True)
    loss = tr._prefixflow_update(model, inputs)
    return float(loss), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def fp64_truth(tr, inputs, monkeypatch) -> tuple[float, dict]:
    """The exact reference of an fp32 micro-batch: TRL's ``compute_loss -> backward`` with the model's fp32 weights
    and buffers cast to fp64 (exactly), :func:`fp64` applied and the batch's float tensors cast to fp64. Call it
    after the fp32 measurements: the model stays in fp64."""
    tr.model.to(torch.float64)
    fp64(tr.model, monkeypatch)
    wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    return trl_grads(tr, wide)


def worst_ratio(got: dict, want: dict) -> float:
    """max over tensors of max|got - want| / max|want|, skipping attention key biases (their gradient is 0 in
    exact arithmetic: rounding noise on both sides, see support.vlm.compare_grads)."""
    return max(
        float((got[n] - w).abs().max() / w.abs().max())
        for n, w in want.items()
        if w is not None and not n.endswith("k_proj.bias")
    )


def trainer(tmp_path, family: str, cls=None, model=None, dataset=None, **options):
    """A trainer (PrefixFlowGRPOTrainer by default) over the tiny VLM set-up; ``prefixflow_*``/``peft_config``/
    ``verify_*`` go to the constructor, the rest to ``GRPOConfig``."""
    from prefixflow.integrations.trl import PrefixFlowGRPOTrainer

    ctor = ("peft_config", "verify_first_step", "verify_tolerance")
    extra = {k: options.pop(k) for k in list(options) if k.startswith("prefixflow_") or k in ctor}
    cls = cls or PrefixFlowGRPOTrainer
    if cls is not PrefixFlowGRPOTrainer:
        extra = {k: v for k, v in extra.items() if k == "peft_config"}
    special = list(SPECIAL[family].values())
    base = {
        "max_completion_length": 8,
        # the placeholder / marker ids are never sampled (TRL suppresses only the image token itself)
        "generation_kwargs": {
            "exponential_decay_length_penalty": (2, 1.6 if family == "qwen2_5_vl" else 3.0),
            "suppress_tokens": special,
        },
    }
    return cls(
        model=model if model is not None else globals()["model"](family),
        reward_funcs=reward_even_words,
        args=config(tmp_path, **{**base, **options}),
        train_dataset=dataset if dataset is not None else globals()["dataset"](),
        processing_class=processor(family),
        **extra,
    )


MM_KEYS = ("pixel_values", "image_grid_thw", "num_images", "token_type_ids", "mm_token_type_ids")


def micro_batch(tr, seed: int = 0, drift: float = 0.3) -> dict:
    """:func:`support.trl_fixtures.micro_batch` with the images TRL's log-prob forward takes (TRL's own
    log-probs, images included, + ``drift`` noise)."""
    return _text_micro_batch(tr, seed, drift, model_keys=MM_KEYS)


def fp64(model, monkeypatch) -> None:
    """fp64 throughout on both sides: HF's norms and vision rotary (support.vlm.neutralise_fp32), the language
    model's RoPE tables (HF's are fp32 in every dtype, and TRL's left padding moves Gemma-3's positions), and
    TRL's LM head (support.trl_fixtures.fp64_trl)."""
    from support.trl_fixtures import fp64_trl

    vlm.neutralise_fp32(model, monkeypatch)
    fp64_trl(monkeypatch)
    for module in model.modules():
        name = type(module).__name__
        if name in ("Qwen2_5_VLRotaryEmbedding", "Qwen3VLTextRotaryEmbedding"):
            module.forward = lambda x, position_ids, m=module: _mrope64(m, x, position_ids)
        elif name == "Gemma3RotaryEmbedding":
            module.forward = lambda x, position_ids, layer_type, m=module: _rope64(
                m, x, position_ids, layer_type
            )


def _mrope64(m, x, position_ids):
    """Qwen-VL's text mRoPE forward with the products in fp64 (the inverse frequencies as stored)."""
    position_ids = position_ids.expand(3, -1, -1)
    freqs = position_ids[..., None].double() * m.inv_freq.to(x.device, torch.float64)
    cos = m.recomposition_frequencies(freqs.cos() * m.attention_scaling)
    sin = m.recomposition_frequencies(freqs.sin() * m.attention_scaling)
    return cos.to(x.dtype), sin.to(x.dtype)


def _rope64(m, x, position_ids, layer_type):
    """Gemma-3's per-layer-type RoPE forward in fp64."""
    inv = getattr(m, f"{layer_type}_inv_freq").to(x.device, torch.float64)
    scale = getattr(m, f"{layer_type}_attention_scaling")
    freqs = position_ids[..., None].double() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


__all__ = [
    "tokenizer", "processor", "dataset", "model", "conditioned", "trainer", "micro_batch", "trl_grads",
    "prefixflow_grads", "fp64_truth", "worst_ratio", "fp64", "SPECIAL",
]  # fmt: skip
