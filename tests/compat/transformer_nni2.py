"""NNI 2.x's Retiarii transformer example, run on tridens.

Written from NNI 2.x's ``examples/nas/multi-trial/transformer/retiarii_transformer_demo.py``: a
``@model_wrapper`` language model whose ``nn.TransformerEncoderLayer`` dropout and
``nn.TransformerEncoder`` depth are ``nn.ValueChoice``s, trained by the user's own loop
(``FunctionalEvaluator(fit)``, ``fit(model_cls)`` building ``model_cls()``, a two-argument
forward ``model(data, src_mask)``, gradient clipping, ``StepLR``), reporting the validation
perplexity (lower is better), searched by ``strategy.Random()`` under ``RetiariiExperiment`` and
exported with ``export_top_models(optimize_mode='minimize')``.

What differs is marked: imports (`# changed import`); the data (`# changed data`): WikiText-2 and
torchtext are not installed offline, so the text is Python's own documentation
(``pydoc_data.topics``, shipped with CPython), one line per item as WikiText's iterators yield,
and the ``basic_english`` tokenizer and the vocabulary are small stand-ins here; and the budget
(`# changed budget`): a small model, two epochs on a fifth of the text, three trials.
"""

import math
import re

import torch
import torch.nn.functional as F
from pydoc_data.topics import topics  # changed data

import tridens.compat.nni as nni  # changed import
import tridens.compat.nni.retiarii.nn.pytorch as nn  # changed import
import tridens.compat.nni.retiarii.strategy as strategy  # changed import
from tridens.compat.nni.retiarii import model_wrapper  # changed import
from tridens.compat.nni.retiarii.evaluator import FunctionalEvaluator  # changed import
from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment  # changed import


def WikiText2(split=None):  # changed data: Python's documentation, 9 topics in 10 to train, the rest to validate
    names = sorted(topics)
    train = [line for i, name in enumerate(names) if i % 10 for line in topics[name].splitlines()]
    valid = [line for i, name in enumerate(names) if not i % 10 for line in topics[name].splitlines()]
    return train if split == 'train' else (train, valid, valid)


def get_tokenizer(name):  # changed data: torchtext's basic_english, lower case, words and punctuation apart
    return lambda line: re.findall(r"[a-z0-9]+|[^\sa-z0-9]", line.lower())


class build_vocab_from_iterator:  # changed data: torchtext's vocabulary, as this script uses it
    def __init__(self, token_lists, specials):
        self.itos = list(specials) + sorted({t for tokens in token_lists for t in tokens} - set(specials))
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.default = 0

    def set_default_index(self, index):
        self.default = index

    def __getitem__(self, token):
        return self.stoi[token]

    def __call__(self, tokens):
        return [self.stoi.get(t, self.default) for t in tokens]

    def __len__(self):
        return len(self.itos)


class PositionalEncoding(nn.Module):

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)

        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe)

    def forward(self, x):
        x = x + self.pe[:x.size(0)]
        return self.dropout(x)


@model_wrapper
class Transformer(nn.Module):

    def __init__(self, n_token: int, n_head: int = 8,
                 d_model: int = 512, d_ff: int = 2048):
        super().__init__()
        p_dropout = nn.ValueChoice([0.1, 0.2, 0.3, 0.4, 0.5], label='p_dropout')
        n_layer = nn.ValueChoice([5, 6, 7, 8, 9], label='n_layer')
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model, n_head, d_ff, p_dropout),
            n_layer
        )
        self.d_model = d_model
        self.decoder = nn.Linear(d_model, n_token)
        self.embeddings = nn.Embedding(n_token, d_model)
        self.position = PositionalEncoding(d_model)

    def forward(self, src, src_mask):
        src = self.embeddings(src) * math.sqrt(self.d_model)
        src = self.position(src)
        output = self.encoder(src, src_mask)
        output = self.decoder(output)
        return output


def fit(model_cls):

    train_iter = WikiText2(split='train')
    tokenizer = get_tokenizer('basic_english')
    vocab = build_vocab_from_iterator(map(tokenizer, train_iter), specials=['<unk>'])
    vocab.set_default_index(vocab['<unk>'])

    def process_data(raw_text_iter):
        data = [torch.tensor(vocab(tokenizer(item)), dtype=torch.long) for item in raw_text_iter]
        return torch.cat(tuple(filter(lambda t: t.numel() > 0, data)))

    train_iter, val_iter, _ = WikiText2()
    train_data = process_data(train_iter)
    val_data = process_data(val_iter)
    train_data = train_data[:len(train_data) // 5]  # changed budget

    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')

    def generate_batches(data, bsz):
        seq_len = data.size(0) // bsz
        data = data[:seq_len * bsz]
        data = data.view(bsz, seq_len).t().contiguous()
        return data.to(device)

    batch_size = 20
    eval_batch_size = 10
    train_data = generate_batches(train_data, batch_size)
    val_data = generate_batches(val_data, eval_batch_size)

    seq_len = 35

    def get_seq(source, i):
        part_len = min(seq_len, len(source) - 1 - i)
        data = source[i:i + part_len]
        target = source[i + 1:i + 1 + part_len].reshape(-1)
        return data, target

    def generate_square_subsequent_mask(sz):
        return torch.triu(torch.ones(sz, sz) * float('-inf'), diagonal=1)

    model = model_cls().to(device)
    lr = 5.0
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.95)

    def train(model):
        model.train()
        src_mask = generate_square_subsequent_mask(seq_len).to(device)
        for i in range(0, train_data.size(0) - 1, seq_len):
            data, target = get_seq(train_data, i)
            part_len = data.size(0)
            if part_len != seq_len:
                src_mask = src_mask[:part_len, :part_len]
            output = model(data, src_mask)
            loss = F.cross_entropy(output.view(-1, output.size(-1)), target)

            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()

    def evaluate(model, eval_data):
        model.eval()
        src_mask = generate_square_subsequent_mask(seq_len).to(device)
        total_loss = 0.
        with torch.no_grad():
            for i in range(0, eval_data.size(0) - 1, seq_len):
                data, target = get_seq(eval_data, i)
                part_len = data.size(0)
                if part_len != seq_len:
                    src_mask = src_mask[:part_len, :part_len]
                output = model(data, src_mask)
                output_flat = output.view(-1, output.size(-1))
                total_loss += part_len * F.cross_entropy(output_flat, target).item()
        return total_loss / (len(eval_data) - 1)

    best_val_loss = float('inf')

    for epoch in range(2):  # changed budget: 20 epochs in NNI
        train(model)
        val_loss = evaluate(model, val_data)
        if val_loss < best_val_loss:
            best_val_loss = val_loss
        scheduler.step()

    best_val_ppl = math.exp(best_val_loss)
    nni.report_final_result(best_val_ppl)


if __name__ == "__main__":

    train_iter = WikiText2(split='train')
    tokenizer = get_tokenizer('basic_english')
    vocab = build_vocab_from_iterator(map(tokenizer, train_iter), specials=['<unk>'])
    vocab.set_default_index(vocab['<unk>'])

    n_token = len(vocab)
    base_model = Transformer(n_token, n_head=2, d_model=32, d_ff=64)  # changed budget: NNI's defaults 8, 512, 2048

    evaluator = FunctionalEvaluator(fit)
    exp = RetiariiExperiment(base_model, evaluator, [], strategy.Random())
    exp_config = RetiariiExeConfig('local')
    exp_config.experiment_name = 'Transformer HPO'
    exp_config.trial_concurrency = 3
    exp_config.max_trial_number = 3  # changed budget: 25 in NNI
    exp_config.trial_gpu_number = 1
    exp_config.training_service.use_active_gpu = False
    export_formatter = 'dict'

    exp.run(exp_config, 8081)
    print('Final model:')
    for model_code in exp.export_top_models(optimize_mode='minimize', formatter=export_formatter):
        print(model_code)
