"""An NNI 2.x legacy one-shot script whose model is a plain ``nn.Module`` (no ``@model_wrapper``).

Written as NNI 2.x's one-shot examples (``examples/nas/oneshot/darts``) write their search
model: ``nn.Module`` classes from ``nni.retiarii.nn.pytorch`` holding ``LayerChoice`` and
``InputChoice`` (here also a ``ValueChoice`` width), the model built with constructor arguments
and handed to ``DartsTrainer`` / ``EnasTrainer`` / ``SinglePathTrainer``; ``fit()``, ``export()``,
then ``fixed_arch`` to build the chosen network. Only the imports (`# changed import`) and the
data (`# changed data`: 8x8 digits) differ from NNI. The first argument picks the trainer.
"""

import sys

import torch
import torch.nn.functional as F

import tridens.compat.nni.retiarii.nn.pytorch as nn  # changed import
from tridens.compat.nni.retiarii import fixed_arch  # changed import
from tridens.compat.nni.retiarii.oneshot.pytorch import DartsTrainer, EnasTrainer, SinglePathTrainer  # changed import
from tridens.datasets import digits  # changed data


def candidate_ops(channels):
    return [
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, groups=channels), nn.Conv2d(channels, channels, 1)),
        nn.MaxPool2d(3, stride=1, padding=1),
    ]


class Node(nn.Module):
    def __init__(self, node_id, num_prev, channels):
        super().__init__()
        self.ops = nn.ModuleList()
        for i in range(num_prev):
            self.ops.append(nn.LayerChoice(candidate_ops(channels), label=f'{node_id}_op{i}'))
        self.input_switch = nn.InputChoice(n_candidates=num_prev, n_chosen=1, label=f'{node_id}_switch')

    def forward(self, prev_nodes):
        return self.input_switch([op(node) for op, node in zip(self.ops, prev_nodes)])


class Cell(nn.Module):
    def __init__(self, n_nodes, channels):
        super().__init__()
        self.nodes = nn.ModuleList([Node(f'node{depth}', depth + 1, channels) for depth in range(n_nodes)])

    def forward(self, x):
        states = [x]
        for node in self.nodes:
            states.append(F.relu(node(states)))
        return states[-1]


class CNN(nn.Module):
    def __init__(self, in_channels, n_classes, n_nodes):
        super().__init__()
        channels = nn.ValueChoice([8, 16], label='width')
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.cell = Cell(n_nodes, channels)
        self.linear = nn.Linear(channels, n_classes)

    def forward(self, x):
        return self.linear(self.cell(self.stem(x)).mean((2, 3)))


def accuracy(output, target):
    return {'acc': (output.argmax(1) == target).float().mean().item()}


if __name__ == '__main__':
    mode = sys.argv[1] if len(sys.argv) > 1 else 'darts'
    dataset_train, dataset_valid = digits()  # changed data
    model = CNN(1, 10, 2)
    criterion = torch.nn.CrossEntropyLoss()
    optim = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9, weight_decay=3.0E-4)
    if mode == 'darts':
        trainer = DartsTrainer(model=model, loss=criterion, metrics=accuracy, optimizer=optim, num_epochs=2,
                               dataset=dataset_train, batch_size=64, log_frequency=10, arc_learning_rate=3e-3)
    elif mode == 'enas':
        trainer = EnasTrainer(model, loss=criterion, metrics=accuracy, reward_function=lambda out, y: accuracy(out, y)['acc'],
                              optimizer=optim, batch_size=64, num_epochs=2, dataset=dataset_train, log_frequency=10,
                              ctrl_steps_aggregate=4)
    else:
        trainer = SinglePathTrainer(model, criterion, accuracy, optim, 2, dataset_train, dataset_valid, batch_size=64)
    trainer.fit()
    final_architecture = trainer.export()
    print('Final architecture:', final_architecture)
    with fixed_arch(final_architecture):
        final_model = CNN(1, 10, 2)
    x, y = dataset_valid.tensors
    print('final model:', sum(p.numel() for p in final_model.parameters()), 'parameters, output',
          tuple(final_model(x[:4]).shape))
