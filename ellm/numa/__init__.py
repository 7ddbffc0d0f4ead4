"""NUMA: the machine's topology (sysfs), layout plans over its nodes, and placement at run time."""
