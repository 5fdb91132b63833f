"""Training data: the built-in generated corpus, text files, token files, and the batch sampler.

Tokens live in one 1-D array per split (a numpy array, or a numpy.memmap for token files, so a corpus larger
than memory is read on demand). The sampler cuts a split into windows of seq_len + 1 tokens and visits them
in a fresh seeded permutation each epoch; its only state is the number of windows consumed, so a resumed
run continues with exactly the batches it would have seen.
"""
import os
import random

import numpy as np
import torch

from flash_attn.training.config import ConfigError

TOKEN_EXTENSIONS = (".npy", ".bin")


# ------------------------------------------------------------------------------------------ tokenizers
class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): needs no file and never meets an unknown character."""

    vocab_size = 256
    name = "byte"

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class JSONTokenizer:
    """A ``tokenizers`` tokenizer loaded from its JSON file (e.g. a model's tokenizer.json)."""

    def __init__(self, path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path!r} (data.tokenizer)")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ConfigError(f"data.tokenizer={path!r} needs the tokenizers package: pip install tokenizers") from e
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ConfigError(f"{path!r} is not a tokenizers JSON file: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.name = path

    def encode(self, text):
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def get_tokenizer(spec):
    """``byte`` or the path of a tokenizers JSON file."""
    return ByteTokenizer() if spec == "byte" else JSONTokenizer(spec)


# ------------------------------------------------------------------------------------------ synthetic corpus
_NOUNS = ["cat", "dog", "fox", "bird", "horse", "child", "teacher", "farmer", "robot", "sailor", "king", "wolf"]
_PLURAL = {"child": "children", "wolf": "wolves", "fox": "foxes"}
_ADJS = ["red", "small", "old", "quick", "lazy", "happy", "quiet", "brave", "green", "tall"]
_VERBS = ["see", "like", "chase", "follow", "help", "watch", "call", "find"]
_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve"]


def _plural(noun):
    return _PLURAL.get(noun, noun + "s")


def _noun_phrase(rng):
    noun = rng.choice(_NOUNS)
    adj = rng.choice(_ADJS) + " " if rng.random() < 0.5 else ""
    if rng.random() < 0.5:
        return f"the {adj}{noun}", True
    return f"{rng.choice(['the', 'some', 'two', 'many'])} {adj}{_plural(noun)}", False


def _sentence(rng):
    # Subject-verb agreement: a singular subject takes "sees", a plural one "see".
    subject, singular = _noun_phrase(rng)
    verb = rng.choice(_VERBS)
    verb = (verb + "es" if verb.endswith(("ch", "sh")) else verb + "s") if singular else verb
    obj, _ = _noun_phrase(rng)
    return f"{subject} {verb} {obj}."


def _arithmetic(rng):
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a} + {b} = {a + b}."


def _story(rng):
    # Recall across the line: the answer is whoever was named earlier, learnable only through attention.
    giver, taker = rng.sample(_NAMES, 2)
    thing = rng.choice(["book", "apple", "key", "letter", "coin", "map"])
    return f"{giver} gave the {thing} to {taker}. {taker} thanked {giver}."


def _counting(rng):
    start = rng.randrange(len(_NUMBER_WORDS) - 4)
    return "count: " + " ".join(_NUMBER_WORDS[start:start + rng.randrange(3, 5)]) + "."


def _copy(rng):
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(4, 8)))
    return f"say {word}. {word}!"


_LINES = (_sentence, _arithmetic, _story, _counting, _copy)


def synthetic_corpus(num_chars, seed=1234):
    """A deterministic ASCII corpus of about num_chars characters with learnable structure.

    Lines of five kinds: sentences with subject-verb agreement, correct two-digit sums, short stories whose
    second sentence repeats names from the first, counting in number words, and random words said twice.
    Spelling is learned first, then the structure that needs attention (recall, copying), so the loss
    keeps falling for a while. Same (num_chars, seed) -> same text.
    """
    rng = random.Random(seed)
    parts, total = [], 0
    while total < num_chars:
        line = rng.choice(_LINES)(rng) + "\n"
        parts.append(line)
        total += len(line)
    return "".join(parts)[:num_chars]


# ------------------------------------------------------------------------------------------ loading
def _smallest_dtype(vocab_size):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def read_tokens(path, token_dtype="uint16"):
    """A 1-D token array from a .npy file (any integer dtype) or a raw .bin file of token_dtype, memory-mapped."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"token file not found: {path!r}")
    if path.endswith(".npy"):
        try:
            tokens = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise ConfigError(f"{path!r} is not a .npy array file: {e}") from e
    else:
        dtype = np.dtype(token_dtype)
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise ConfigError(f"token file {path!r} has {size} bytes, not a multiple of {token_dtype} "
                              f"({dtype.itemsize} bytes); is data.token_dtype right?")
        if size == 0:
            raise ConfigError(f"token file {path!r} is empty")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"token file {path!r} must hold a 1-D integer array, got {tokens.dtype} "
                          f"{tokens.shape}")
    return tokens


def read_text_tokens(path, tokenizer):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file not found: {path!r}")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text:
        raise ConfigError(f"text file {path!r} is empty")
    return tokenizer.encode(text).astype(_smallest_dtype(tokenizer.vocab_size))


def _is_token_file(path, fmt):
    if fmt == "auto":
        return path.endswith(TOKEN_EXTENSIONS)
    return fmt == "tokens"


def _load_split(path, cfg, tokenizer):
    if path == "synthetic":
        if not isinstance(tokenizer, ByteTokenizer):
            raise ConfigError("data.train=synthetic is byte-level text: use data.tokenizer=byte")
        return tokenizer.encode(synthetic_corpus(cfg.synthetic_chars, cfg.synthetic_seed)).astype(np.uint8)
    if _is_token_file(path, cfg.format):
        return read_tokens(path, cfg.token_dtype)
    return read_text_tokens(path, tokenizer)


def max_token(tokens, chunk=1 << 24):
    """Largest id in a (possibly memory-mapped) token array, read in chunks."""
    return max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))


def load_splits(cfg):
    """(train_tokens, val_tokens, tokenizer) from a DataConfig; val is data.val or train's last val_fraction."""
    tokenizer = get_tokenizer(cfg.tokenizer)
    train = _load_split(cfg.train, cfg, tokenizer)
    if cfg.val is not None:
        val = _load_split(cfg.val, cfg, tokenizer)
    else:
        cut = int(len(train) * (1.0 - cfg.val_fraction))
        train, val = train[:cut], train[cut:]
    return train, val, tokenizer


def prepare_tokens(text_path, out_path, tokenizer_spec="byte", chunk_chars=1 << 22):
    """Tokenize a text file into a .npy token file (uint16, or uint32 for vocabularies over 65536) for
    data.train; the text is read in line-aligned chunks so the file need not fit in memory twice."""
    if not out_path.endswith(".npy"):
        raise ConfigError(f"output token file must end in .npy, got {out_path!r}")
    if not os.path.isfile(text_path):
        raise FileNotFoundError(f"text file not found: {text_path!r}")
    tokenizer = get_tokenizer(tokenizer_spec)
    dtype = _smallest_dtype(tokenizer.vocab_size)
    pieces = []
    with open(text_path, encoding="utf-8", errors="replace") as f:
        while True:
            # Whole lines only: a tokenizer must not see a word cut in two at a chunk border.
            text = f.read(chunk_chars)
            if not text:
                break
            text += f.readline()
            pieces.append(tokenizer.encode(text).astype(dtype))
    if not pieces:
        raise ConfigError(f"text file {text_path!r} is empty")
    total = sum(len(p) for p in pieces)
    tmp = out_path + ".tmp.npy"
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total,))
    pos = 0
    for p in pieces:
        out[pos:pos + len(p)] = p
        pos += len(p)
    out.flush()
    del out
    os.replace(tmp, out_path)
    return total


# ------------------------------------------------------------------------------------------ sampling
class WindowSampler:
    """Windows of seq_len + 1 tokens (inputs and shifted targets) over a token array.

    Window w covers tokens [w * seq_len, w * seq_len + seq_len]: consecutive windows share one token, so every
    token but the first is a target exactly once per epoch. Sample k of the run is window perm_e[k % n] of
    epoch e = k // n, where perm_e is a permutation seeded by (seed, e).
    """

    def __init__(self, tokens, seq_len, seed=0, shuffle=True, name="train"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(f"the {name} split has {len(tokens)} tokens, fewer than train.seq_len + 1 "
                              f"({seq_len + 1}); use more data or a shorter sequence")
        self.seed = seed
        self.shuffle = shuffle
        self._perm_epoch, self._perm = None, None

    def _window(self, k):
        epoch, j = divmod(k, self.num_windows)
        if self.shuffle:
            if self._perm_epoch != epoch:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.num_windows, generator=g).numpy()
                self._perm_epoch = epoch
            j = int(self._perm[j])
        start = j * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def batch(self, first, count):
        """Samples first .. first + count - 1 -> (inputs, targets), each (count, seq_len) int64 on the CPU."""
        windows = torch.from_numpy(np.stack([self._window(k) for k in range(first, first + count)]))
        return windows[:, :-1], windows[:, 1:]
