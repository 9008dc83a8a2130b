"""NNI 2.x's one-shot test space "multi-head attention", run on tridens.

Written from NNI 2.10's ``test/algo/nas/test_oneshot.py``: ``MultiHeadAttentionNet`` (a
``ValueChoice`` of ``embed_dim`` into ``nn.Linear`` and ``nn.MultiheadAttention``, a ``(query, key,
value)`` batch) under ``RetiariiExperiment`` with ``execution_engine = 'oneshot'`` and the
Lightning ``Regression`` evaluator, one strategy per run, then ``export_top_models()``. Only the
imports (`# changed import`) and the data (`# changed data`: NNI draws uniform random q, k, v
and targets; here each digit's 64 pixels are query, key and value, and the target is the digit's
class / 9) differ, and ``fixed_arch`` builds the exported architecture at the end (`# added`).
The first argument picks the strategy: darts, enas, random or gumbel.

NNI's network is kept as NNI wrote it: ``nn.MultiheadAttention`` is not ``batch_first``, so a
batch of ``(32, 1, 64)`` samples is one sequence of 32 tokens (each sample attends over its
batch), and the output goes through a ReLU, which an unlucky initialization leaves at zero for
every sample. NNI's test checks that the search runs and exports an architecture; so does this one.
"""

import sys

import torch.nn.functional as F
from torch.utils.data import Dataset

import tridens.compat.nni.retiarii.nn.pytorch as nn  # changed import
from tridens.compat.nni.retiarii import fixed_arch, model_wrapper, strategy  # changed import
from tridens.compat.nni.retiarii.evaluator.pytorch.lightning import DataLoader, Regression  # changed import
from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment  # changed import
from tridens.compat.nni.retiarii.nn.pytorch import ValueChoice  # changed import
from tridens.datasets import digits  # changed data


@model_wrapper
class MultiHeadAttentionNet(nn.Module):
    def __init__(self, head_count):
        super().__init__()
        embed_dim = ValueChoice(candidates=[32, 64])
        self.linear1 = nn.Linear(64, embed_dim)  # changed data: 64 pixels where NNI draws 128 numbers
        self.mhatt = nn.MultiheadAttention(embed_dim, head_count)
        self.linear2 = nn.Linear(embed_dim, 1)

    def forward(self, batch):
        query, key, value = batch
        q, k, v = self.linear1(query), self.linear1(key), self.linear1(value)
        output, _ = self.mhatt(q, k, v, need_weights=False)
        y = self.linear2(output)
        return F.relu(y)


class AttentionDigitsDataset(Dataset):  # changed data: NNI's AttentionRandDataset draws torch.rand
    def __init__(self, images, labels) -> None:
        super().__init__()
        self.images = images.reshape(len(images), 1, 64)
        self.targets = labels.float().reshape(len(labels), 1, 1) / 9

    def __getitem__(self, index):
        q = k = v = self.images[index]
        return (q, k, v), self.targets[index]

    def __len__(self):
        return len(self.images)


def _multihead_attention_net(evaluator_kwargs):
    base_model = MultiHeadAttentionNet(1)
    train_data, val_data = digits()  # changed data
    train_set = AttentionDigitsDataset(*train_data.tensors)  # changed data
    val_set = AttentionDigitsDataset(*val_data.tensors)  # changed data
    train_loader = DataLoader(train_set, batch_size=32)
    val_loader = DataLoader(val_set, batch_size=32)

    evaluator = Regression(train_dataloader=train_loader, val_dataloaders=val_loader, **evaluator_kwargs)
    return base_model, evaluator


if __name__ == '__main__':
    name = sys.argv[1] if len(sys.argv) > 1 else 'darts'
    strategy_ = {'darts': lambda: strategy.DARTS(), 'enas': lambda: strategy.ENAS(reward_metric_name='val_mse'),
                 'random': lambda: strategy.RandomOneShot(), 'gumbel': lambda: strategy.GumbelDARTS()}[name]()
    base_model, evaluator = _multihead_attention_net({'max_epochs': 1})
    experiment = RetiariiExperiment(base_model, evaluator, strategy=strategy_)
    config = RetiariiExeConfig()
    config.execution_engine = 'oneshot'
    experiment.run(config)
    arch = experiment.export_top_models()[0]
    assert isinstance(arch, dict)
    print('exported:', arch)
    with fixed_arch(arch):  # added
        final_model = MultiHeadAttentionNet(1)  # added
    print('final model: embed_dim', final_model.mhatt.embed_dim,  # added
          'in_proj_weight', tuple(final_model.mhatt.in_proj_weight.shape))  # added
