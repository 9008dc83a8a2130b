"""An NNI 3.x one-shot NAS script, run on tridens.

Written as NNI 3.x documents it (a ModelSpace with LayerChoice and nni.choice in Mutable*
constructor arguments, the Lightning Classification evaluator over DataLoaders, a one-shot
strategy from nni.nas.strategy, NasExperiment, export_top_models, model_context); only the import
lines (marked `# changed import`) and the data (`# changed data`: scikit-learn's 8x8 digits,
since torchvision cannot download offline) differ. The strategy is the first argument:
darts, gdas, enas or spos.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import tridens.compat.nni as nni  # changed import
from tridens.compat.nni.nas.evaluator.pytorch import Classification, DataLoader  # changed import
from tridens.compat.nni.nas.experiment import NasExperiment  # changed import
from tridens.compat.nni.nas.nn.pytorch import LayerChoice, ModelSpace, MutableBatchNorm2d, MutableConv2d, MutableLinear  # changed import
from tridens.compat.nni.nas.space import model_context  # changed import
from tridens.compat.nni.nas.strategy import DARTS, ENAS, GumbelDARTS, RandomOneShot  # changed import
from tridens.datasets import digits  # changed data


class DepthwiseSeparableConv(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, kernel_size=3, padding=1, groups=channels)
        self.pointwise = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x):
        return self.pointwise(self.depthwise(x))


class Net(ModelSpace):
    def __init__(self):
        super().__init__()
        width = nni.choice('width', [16, 32])
        self.stem = MutableConv2d(1, width, 3, padding=1)
        self.bn = MutableBatchNorm2d(width)
        self.op = LayerChoice([
            nn.Conv2d(width, width, 3, padding=1),
            DepthwiseSeparableConv(width),
            nn.MaxPool2d(3, stride=1, padding=1),
        ], label='op')
        hidden = nni.choice('hidden', [32, 64])
        self.fc1 = MutableLinear(width * 4 * 4, hidden)
        self.fc2 = MutableLinear(hidden, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = F.max_pool2d(F.relu(self.op(x)), 2)  # 8x8 -> 4x4
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def accuracy(model, dataset):
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in DataLoader(dataset, batch_size=256))
    return correct / len(dataset)


if __name__ == '__main__':
    name = sys.argv[1] if len(sys.argv) > 1 else 'darts'
    train_data, val_data = digits()  # changed data
    evaluator = Classification(
        learning_rate=3e-3,
        weight_decay=0.,
        train_dataloaders=DataLoader(train_data, batch_size=64, shuffle=True),
        val_dataloaders=DataLoader(val_data, batch_size=64),
        max_epochs=2,
        num_classes=10,
    )
    strategy = {
        'darts': lambda: DARTS(arc_learning_rate=3e-3),
        'gdas': lambda: GumbelDARTS(temperature=(1.0, 0.33), arc_learning_rate=3e-3),
        'enas': lambda: ENAS(batches_per_update=4),
        'spos': lambda: RandomOneShot(),
    }[name]()

    model_space = Net()
    exp = NasExperiment(model_space, evaluator, strategy)
    exp.run()

    exported_arch = exp.export_top_models(formatter='dict')[0]
    print('exported architecture:', exported_arch)
    best_model = exp.export_top_models(formatter='instance')[0]
    print(f'exported model accuracy: {accuracy(best_model, val_data):.6f}')

    with model_context(exported_arch):
        final_model = Net()
    print('rebuilt for retraining:', sum(p.numel() for p in final_model.parameters()), 'parameters,',
          sum(p.numel() for p in best_model.parameters()), 'exported')
