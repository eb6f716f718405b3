"""The numbers: the calibration sums (sums), their products (products), the Hadamard rotation (hadamard), the least-
squares fit of the operators (fitting) and finiteness checks (finite)."""
