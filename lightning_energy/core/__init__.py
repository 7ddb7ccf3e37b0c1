"""The framework-free measurement core: a run's session, its one timeline fed by explicit calls, its figures,
report and trace. No Lightning import here (``tests/test_layout.py`` proves it); the front ends (the Trainer's
callbacks, the Fabric monitor, the plain-PyTorch meter, the process monitor) drive it."""
