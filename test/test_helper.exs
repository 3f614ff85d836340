ExUnit.start(exclude: [:soak])
