"""What every rank uses: the mesh, start-up, traced collectives, hand-written algorithms, the trace."""
