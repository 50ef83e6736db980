"""Small real Hugging Face tokenizers, trained offline on a few standard-library modules and
saved by ``transformers`` (shared by the tokenizer and the fine-tuning tests): a GPT-2
byte-level BPE, a BERT WordPiece and a T5 SentencePiece unigram."""
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


