// The decode kernel compiled for avx512 (flags in setup.py); see decode.cpp.
#include "decode.cpp"
