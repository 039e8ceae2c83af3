"""Two questions about one long table: the second reuses the table's KV blocks from the prefix cache."""

import sys
import time

from nanoengine import LLM, SamplingParams

ROWS = [("John Doe", 29, "Engineer", "USA"), ("Jane Smith", 34, "Doctor", "Canada"),
        ("Alice Johnson", 27, "Teacher", "UK"), ("Bob Brown", 45, "Artist", "Australia"),
        ("Carol White", 31, "Scientist", "New Zealand"), ("Zack Blue", 30, "Lawyer", "Australia")]
LONG_PROMPT = ("You are a helpful assistant that reads tables in markdown. Here is a table.\n"
               "| ID | Name | Age | Occupation | Country |\n|----|------|-----|------------|---------|\n"
               + "".join(f"| {i} | {name} | {age} | {job} | {country} |\n"
                         for i, (name, age, job, country) in enumerate(ROWS * 5, start=1)))


def get_generation_time(llm: LLM, sampling_params: SamplingParams, prompts: str) -> None:
    start_time = time.time()
    output = llm.generate(prompts, sampling_params=sampling_params)
    print("-" * 30)
    print(f"Output: {output[0].outputs[0].text}")
    print(f"Generation time: {time.time() - start_time} seconds.")
    print("-" * 30)


def main(model: str) -> None:
    llm = LLM(model=model, enable_prefix_caching=True)
    sampling_params = SamplingParams(temperature=0, max_tokens=10)
    for name in ("John Doe", "Zack Blue"):
        get_generation_time(llm, sampling_params,
                            LONG_PROMPT + f"Question: what is the age of {name}? Your answer: The age of {name} is ")


if __name__ == "__main__":
    main(sys.argv[1])
