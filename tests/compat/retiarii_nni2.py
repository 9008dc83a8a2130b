"""An NNI 2.x (Retiarii) one-shot NAS script, run on tridens.

Written as NNI 2.8-2.10 documents it: ``@model_wrapper`` on an ``nn.Module`` built from
``nni.retiarii.nn.pytorch`` (``ValueChoice``, ``LayerChoice``), then either the strategy API
(``RetiariiExperiment`` with ``nni.retiarii.strategy.DARTS`` and the Lightning ``Classification``
evaluator, ``execution_engine = 'oneshot'``) or a legacy trainer (``DartsTrainer`` /
``EnasTrainer`` / ``SinglePathTrainer``: ``fit()`` and ``export()``), then ``fixed_arch``. Only the
imports (`# changed import`) and the data (`# changed data`: 8x8 digits) differ from NNI.
The first argument picks the path: strategy, darts-trainer, enas-trainer or spos-trainer.
"""

import sys

import torch
import torch.nn.functional as F

import tridens.compat.nni.retiarii.evaluator.pytorch.lightning as pl  # changed import
import tridens.compat.nni.retiarii.nn.pytorch as nn  # changed import
import tridens.compat.nni.retiarii.strategy as strategy  # changed import
from tridens.compat.nni.retiarii import fixed_arch, model_wrapper  # changed import
from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment  # changed import
from tridens.compat.nni.retiarii.oneshot.pytorch import DartsTrainer, EnasTrainer, SinglePathTrainer  # changed import
from tridens.datasets import digits  # changed data


@model_wrapper
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        ch = nn.ValueChoice([16, 32], label='width')
        self.conv1 = nn.Conv2d(1, ch, 3, padding=1)
        self.conv2 = nn.LayerChoice([
            nn.Conv2d(ch, ch, 3, padding=1),
            nn.Conv2d(ch, ch, 5, padding=2),
        ], label='conv2')
        self.fc = nn.Linear(ch, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


if __name__ == '__main__':
    mode = sys.argv[1] if len(sys.argv) > 1 else 'strategy'
    train_data, val_data = digits()  # changed data
    model = Net()
    if mode == 'strategy':
        evaluator = pl.Classification(train_dataloader=pl.DataLoader(train_data, batch_size=64),
                                      val_dataloaders=pl.DataLoader(val_data, batch_size=64),
                                      max_epochs=2, learning_rate=3e-3)
        exp = RetiariiExperiment(model, evaluator, [], strategy.DARTS(arc_learning_rate=3e-3))
        config = RetiariiExeConfig()
        config.execution_engine = 'oneshot'
        exp.run(config)
        arch = exp.export_top_models()[0]
    else:
        trainer_cls = {'darts-trainer': DartsTrainer, 'enas-trainer': EnasTrainer, 'spos-trainer': SinglePathTrainer}[mode]
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)

        def accuracy(output, target):
            return {'acc': (output.argmax(1) == target).float().mean().item()}

        if trainer_cls is DartsTrainer:
            trainer = DartsTrainer(model, criterion, accuracy, optimizer, num_epochs=2, dataset=train_data,
                                   batch_size=64, arc_learning_rate=3e-3)
        elif trainer_cls is EnasTrainer:
            trainer = EnasTrainer(model, criterion, accuracy, lambda out, y: accuracy(out, y)['acc'], optimizer,
                                  num_epochs=2, dataset=train_data, batch_size=64, ctrl_steps_aggregate=4)
        else:
            trainer = SinglePathTrainer(model, criterion, accuracy, optimizer, num_epochs=2, dataset_train=train_data,
                                        dataset_valid=val_data, batch_size=64)
        trainer.fit()
        arch = trainer.export()
    print('final architecture:', arch)
    with fixed_arch(arch):
        final_model = Net()
    print('final model:', sum(p.numel() for p in final_model.parameters()), 'parameters,',
          'conv2 kernel', final_model.conv2.kernel_size[0])
