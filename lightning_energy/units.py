"""Every unit constant of lightning_energy, once, named by what it converts: ``A_PER_B`` turns a value in B into A
(``power_W = power_mW * W_PER_MW``). ``MW`` and ``MJ`` in these names are milliwatts and millijoules, NVML's and
Zeus's units (nothing here uses megawatts); ``UJ`` microjoules (RAPL's ``energy_uj``).
"""

W_PER_MW = 1e-3  # watts per milliwatt: NVML power readings and Zeus's power figures are in mW
J_PER_MJ = 1e-3  # joules per millijoule: NVML's total energy counter and Zeus's energy figures count mJ
MW_PER_W = 1000  # milliwatts per watt, an int: NVML takes power limits as integer mW
MJ_PER_J = 1000  # millijoules per joule, an int: the simulated GPU's energy counter counts integer mJ as NVML's does
J_PER_UJ = 1e-6  # joules per microjoule: RAPL's energy_uj counters
J_PER_KWH = 3.6e6  # joules per kilowatt-hour
MS_PER_S = 1000.0  # milliseconds per second: torch.cuda.Event.elapsed_time reports ms
FLOP_PER_GFLOP = 1e9  # floating-point operations per GFLOP
BYTES_PER_GIB = 1024**3  # bytes per gibibyte
G_PER_KG = 1000.0  # grams per kilogram: CodeCarbon's emissions are kg CO2e
J_PER_KJ = 1000.0  # joules per kilojoule: the progress bar shows kJ
US_PER_S = 1e6  # microseconds per second: Chrome/Kineto traces count us
NS_PER_US = 1000.0  # nanoseconds per microsecond: a trace's baseTimeNanoseconds
