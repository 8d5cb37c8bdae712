"""Several ranks decoding one video: how rows are split into bands with halos (`bands`) and how the ranks agree on
the input and the plan before any work starts (`agreement`)."""
