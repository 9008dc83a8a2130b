"""Small real models for the graph IR tests (shared by the test files of tests/graph)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x.flatten(1))))


class SmallCNN(nn.Module):
    """8x8 digits CNN with BatchNorm and Dropout."""

    def __init__(self, width: int = 16, kernel: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel, padding=kernel // 2)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = self.drop(torch.flatten(x, 1))
        return self.fc(x)


class Residual(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + x)


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = Residual(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.block(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class Branches(nn.Module):
    """Two independent branches joined by torch.cat."""

    def __init__(self, first_a: bool = True) -> None:
        super().__init__()
        self.first_a = first_a
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(1, 6, 5, padding=2)
        self.fc = nn.Linear(10 * 8 * 8, 10)

    def forward(self, x):
        if self.first_a:  # plain Python attribute: resolved while tracing
            ya = self.a(x)
            yb = self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        y = torch.cat([ya, yb], dim=1)
        return self.fc(torch.flatten(torch.relu(y), 1))


class Encoder(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.layer(self.embed(x)).mean(dim=1))


class LSTMClassifier(nn.Module):
    def __init__(self, hidden: int = 12) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, 4)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.fc(out[:, -1])


class DataDependent(nn.Module):
    """fx cannot trace ``if x.sum() > 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(8, 8)
        self.neg = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.pos(x)
        return self.neg(x)


class WithDataDependentBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = DataDependent()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.block(self.inp(x))))


def torch_resnet18(num_classes: int = 10, cifar_stem: bool = False) -> nn.Module:
    """A hand-written ResNet-18 (torchvision layout, no torchvision)."""

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if cifar_stem:
                self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
                self.maxpool = nn.Identity()
            else:
                self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
                self.maxpool = nn.MaxPool2d(3, 2, 1)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            layers, cin = [], 64
            for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
                layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
                cin = cout
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet18()
