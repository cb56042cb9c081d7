"""The benchmarks behind ``ragfix bench``: speed, memory and cost of the backends and of the
evaluation and serving paths (one module per benchmark, each returning its tables and details;
the CLI prints them and keeps them as result files). Above the library and the evaluation: the
library imports nothing from here."""
