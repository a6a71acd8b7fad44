#include <pybind11/pybind11.h>
PYBIND11_MODULE(_kernels, m) { m.def("ping", []() { return 1; }); }
