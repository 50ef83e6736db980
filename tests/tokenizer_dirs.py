"""Small real Hugging Face tokenizers, trained offline on a few standard-library modules and
saved by ``transformers`` (shared by the tokenizer, fine-tuning and harness tests): a GPT-2
byte-level BPE, a Llama-style BPE that adds ``<s>``, a Qwen-style BPE, a BERT WordPiece and
a T5 SentencePiece unigram; and tiny random Llama 3 / Qwen 2.5 / Qwen 3 directories."""
import io
import os

import transformers

STDLIB = os.path.dirname(os.__file__)
CORPUS = [open(os.path.join(STDLIB, name), encoding="utf-8").read()
          for name in ("textwrap.py", "string.py", "json/__init__.py", "shlex.py")]
EXTRA_IDS = 10


def gpt2_dir(root):
    """A GPT-2 BPE (700 pieces + <|endoftext|>) and a GPT2Config of its size in ``root``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(["<|endoftext|>"])           # the last id, as in GPT-2 (50256)
    eot = "<|endoftext|>"
    hf = transformers.GPT2TokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot,
                                        unk_token=eot)
    hf.save_pretrained(root)
    transformers.GPT2Config(vocab_size=len(hf), n_layer=1, n_embd=8, n_head=2,
                            bos_token_id=hf.eos_token_id,
                            eos_token_id=hf.eos_token_id).save_pretrained(root)


def bert_dir(root):
    """A BERT WordPiece (700, lowercased) and a BertConfig of its size in ``root``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=700, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    hf = transformers.BertTokenizerFast(tokenizer_object=tok)
    hf.save_pretrained(root)
    transformers.BertConfig(vocab_size=len(hf), hidden_size=8, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=16).save_pretrained(root)


def spiece_model(path):
    """A T5-layout SentencePiece unigram model (600 pieces) at ``path``."""
    import sentencepiece as spm

    lines = [line for text in CORPUS for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(         # T5's layout: pad 0, eos 1, unk 2, no bos
        sentence_iterator=iter(lines), model_writer=model, vocab_size=600, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
        unk_piece="<unk>", minloglevel=2, num_threads=2)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(model.getvalue())


def t5_config(root):
    """A tiny T5Config with room for ``EXTRA_IDS`` sentinels after the 600 pieces."""
    transformers.T5Config(vocab_size=600 + EXTRA_IDS, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                          num_heads=2, decoder_start_token_id=0).save_pretrained(root)




def llama_tokenizer(root) -> None:
    """A byte-level BPE (600 pieces) that adds ``<s>`` in front, as Llama's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(root)


#: The Llama-style families of ``llama_style_dir``: (HF class prefix, config settings).
#: Llama 3: llama3 RoPE scaling over 16 original positions (texts reach past them);
#: Qwen 2.5: q/k/v biases, tied; Qwen 3: q/k norms and a head size (16) that is not D / N.
LLAMA_STYLE = {
    "llama3": ("Llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3", dict(head_dim=16, rope_theta=1e6)),
}


def qwen_tokenizer(root) -> None:
    """A byte-level BPE (600 pieces) split as Qwen's tokenizer splits (transformers'
    ``Qwen2Tokenizer`` pipeline: NFC, its pre-tokenizer regex, byte-level), no bos, and
    ``<|endoftext|>`` (id 600) as end of text and padding, as in Qwen 2.5 and Qwen 3. (For a
    ``qwen2`` directory transformers builds that pipeline whatever tokenizer.json says.)"""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(["<|endoftext|>"])
    eot = "<|endoftext|>"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot,
                                         pad_token=eot).save_pretrained(root)


def llama_style_dir(root, family: str, max_len: int = 128, seed: int = 0) -> None:
    """The family's tokenizer (``llama_tokenizer``: Llama 3; ``qwen_tokenizer``: Qwen) and a
    random ``<Family>ForCausalLM`` of its vocabulary (2 layers, width 32, 2 kv heads of 4)
    in ``root``; the biases and norm weights moved off HF's init (zeros, ones) so that each
    is exercised."""
    import torch

    qwen = family.startswith("qwen")
    (qwen_tokenizer if qwen else llama_tokenizer)(root)
    prefix, settings = LLAMA_STYLE[family]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=601 if qwen else 600, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_len, bos_token_id=None if qwen else 1,
        eos_token_id=600 if qwen else 2, pad_token_id=None, **settings)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root)
