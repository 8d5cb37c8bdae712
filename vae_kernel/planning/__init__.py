"""Memory planning: the peak working memory of a plan, replayed from shapes, and the choice of frames per pass and
tiles (`memory`)."""
